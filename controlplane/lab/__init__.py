"""The local lab: the whole system on one machine (`make up`)."""
