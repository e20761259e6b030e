"""Cost rollups and budgets."""
