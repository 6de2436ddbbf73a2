"""Serving engines run for real: the programs, the conversions they need, and the verify loop driven through them."""
