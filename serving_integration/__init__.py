"""Cache policies, serving simulator, SGLang plugin ."""
