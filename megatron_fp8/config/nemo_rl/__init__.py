"""NeMo-RL's config files as NeMo-RL writes and means them: ``defaults:`` inheritance and interpolation, NeMo-RL's
known key set (``keys.yaml``, package data) and the translation of its importance-sampling keys."""
