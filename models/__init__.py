"""PBKV predictors (issue 3)."""
