"""What the simulator and the SGLang plugin share: policies, ledger, prefetch, predictions, routers.

Importing the package registers the baselines (baselines.py) into the one policy registry
(policies.POLICIES), so that any import of policies.py sees every policy."""

from serving_integration.cache import baselines  # noqa: F401  (registers its policies)
