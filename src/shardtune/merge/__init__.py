"""Merging an adapter into its base: what the adapter does to each tensor (dense and expert parameters)."""
