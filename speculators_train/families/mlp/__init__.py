"""The MLP speculator family (IBM, arXiv 2404.19124)."""
