/* Meridian dashboard: draws the plotly figures a page embeds, asks before destructive
   actions, and copies a new API key. Everything else is server-rendered HTML and htmx. */
(function () {
  "use strict";

  function plotConfig() {
    return {
      displaylogo: false,
      responsive: true,
      modeBarButtonsToRemove: ["select2d", "lasso2d"],
      // The world map's topojson is served by this site; plotly fetches <url>world_110m.json.
      topojsonURL: document.body.dataset.topojsonUrl
    };
  }

  function drawFigures(root) {
    if (typeof window.Plotly === "undefined") { return; }
    root.querySelectorAll("[data-figure]").forEach(function (element) {
      var source = document.getElementById(element.dataset.figure);
      if (!source) { return; }
      var figure = JSON.parse(source.textContent);
      window.Plotly.react(element, figure.data, figure.layout, plotConfig());
    });
  }

  document.addEventListener("DOMContentLoaded", function () { drawFigures(document); });
  document.addEventListener("htmx:afterSwap", function (event) { drawFigures(event.target); });

  // Forms marked data-confirm ask first; the server still checks roles on every POST.
  document.addEventListener("submit", function (event) {
    var question = event.target.dataset ? event.target.dataset.confirm : null;
    if (question && !window.confirm(question)) { event.preventDefault(); }
  }, true);

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) { return; }
    var text = document.getElementById(button.dataset.copy).textContent;
    if (navigator.clipboard) {
      navigator.clipboard.writeText(text).then(function () { button.textContent = "Copied"; },
                                               function () { button.textContent = "Select and copy"; });
    }
  });
})();
