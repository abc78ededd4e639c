"""Cache policies, serving simulator, SGLang plugin (issues 4, 5)."""
