"""validate: the policy answers held-out prompts; every reward scores them."""
