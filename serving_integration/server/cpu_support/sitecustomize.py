"""Runs at interpreter start in every SGLang server process launched with `launch --cpu`
(this directory is on their PYTHONPATH; see README.md beside it): installs the torchvision import
guard before sglang is imported."""

try:
    from serving_integration.server.compat import install_torchvision_guard

    install_torchvision_guard()
except Exception as e:  # noqa: BLE001  (never break interpreter start; sglang's import will say more)
    import sys

    print(f"pbkv cpu_support sitecustomize: torchvision guard not installed: {e}", file=sys.stderr)
