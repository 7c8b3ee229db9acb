"""Operator families, one package or module each; importing registers torch.ops.fullgraph."""
