"""Cache policies, serving simulator, SGLang plugin."""

from serving_integration import compiled

compiled.install()  # the replay's hot modules from their Cython builds, where those are of the current source
