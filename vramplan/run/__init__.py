"""Real runs: the live-tensor counter for real (CPU) runs and the truths built on it.

Everything under ``vramplan.run`` may import torch; nothing on the estimate path imports it.
"""
