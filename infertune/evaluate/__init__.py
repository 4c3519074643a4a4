"""Accuracy evaluation (`infertune eval`): perplexity, KL, top-1 agreement and greedy prefix against a reference."""

from __future__ import annotations


def __getattr__(name: str):
    # accuracy pulls in torch and the engine; keep `import infertune.evaluate` (and the CLI's --help) light.
    if name in (
        "compare",
        "AccuracyReport",
        "parse_gate",
        "kl_divergence",
        "token_nll",
        "top1_agreement",
        "common_prefix_length",
        "sliding_windows",
    ):
        from infertune.evaluate import accuracy

        return getattr(accuracy, name)
    raise AttributeError(name)


__all__ = [
    "compare",
    "AccuracyReport",
    "parse_gate",
    "kl_divergence",
    "token_nll",
    "top1_agreement",
    "common_prefix_length",
    "sliding_windows",
]
