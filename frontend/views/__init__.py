"""Views of the dashboard, one module per page; common.py holds what they share."""
