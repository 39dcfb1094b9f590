"""Whole jobs as users run them: ebb run on the embedded stack, SIGKILLs, the chaos campaign's
seeds, the examples."""
