"""The web dashboard: server-rendered pages of the fleet, with htmx for live parts."""
