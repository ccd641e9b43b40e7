"""Compute side of ppoflow: tiny local assets, datasets, warm-start training, engines and Ray pools.

Submodules are imported explicitly (``from infra.assets import build_tiny_assets``) so that
importing the package stays free of torch, transformers and Ray.
"""
