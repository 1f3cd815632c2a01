"""A reasoning model's thinking, split from its answer as it streams (``plan``)."""
