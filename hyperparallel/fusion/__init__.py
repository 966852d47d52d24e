"""DVM: a graph-fusion backend for torch.compile (docs/fusion.md)."""
