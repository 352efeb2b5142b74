"""Glue that puts tierkv tiers inside other serving engines (each an optional extra)."""
