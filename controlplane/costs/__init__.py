"""Costs: $/h per replica, spend attributed by tokens to models, regions and tenants; budgets."""
