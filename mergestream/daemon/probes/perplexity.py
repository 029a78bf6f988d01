"""``perplexity``: a causal LM on a UTF-8 text file.

Metric ``perplexity`` (renamed by ``metric``): exp of the mean next-token negative log-likelihood
(nats) over the file's tokens, sliding windows of ``max_length`` tokens moved by ``stride``;
≥ 1, ``inf`` on overflow.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ...datasteps.text import load_model, max_positions
from .base import ProbeContext, ProbeError, data_file, positive_int, probe_device, tokenizer_for

log = logging.getLogger(__name__)


class PerplexityProbe:
    """Causal-LM perplexity on a UTF-8 text file.

    The whole file is tokenized once (special tokens as the tokenizer adds them) and cut to
    ``max_tokens``; windows of ``max_length`` tokens start every ``stride`` tokens and each token is
    scored once, in the first window that reaches it, conditioned on the rest of that window (the
    first token of the file is never scored). Perplexity = exp(Σ NLL / scored tokens).

    Args:
        data: text file (UTF-8).
        metric: metric name (default ``perplexity``).
        max_length: window length in tokens (default: min(1024, the model's positions)).
        stride: window step in tokens, ≤ max_length (default: max_length, no overlap).
        max_tokens: score only the first N tokens of the file (default all).
        name: probe name (default ``perplexity``).

    Raises:
        ProbeError: missing data file or bad parameters; at call time fewer than two tokens, no
            tokenizer, a model that is not a causal LM, or non-finite logits.
    """

    def __init__(self, data: str | Path | None = None, metric: str = "perplexity", max_length: int | None = None,
                 stride: int | None = None, max_tokens: int | None = None, name: str = "perplexity"):
        self.data = data_file(data, "perplexity")
        self.metric = metric
        self.max_length = positive_int(max_length, "perplexity: max_length")
        self.stride = positive_int(stride, "perplexity: stride")
        self.max_tokens = positive_int(max_tokens, "perplexity: max_tokens")
        if self.stride is not None and self.max_length is not None and self.stride > self.max_length:
            raise ProbeError(f"perplexity: stride {self.stride} > max_length {self.max_length} would skip tokens")
        self.name = name

    @torch.inference_mode()
    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{metric: perplexity}`` (≥ 1; ``inf`` if exp overflows)."""
        text = self.data.read_text(encoding="utf-8")
        dev = probe_device(ctx)
        tok = tokenizer_for(Path(model_dir), ctx)
        ids = tok(text, return_attention_mask=False, verbose=False)["input_ids"]
        if self.max_tokens is not None:
            ids = ids[: self.max_tokens]
        n = len(ids)
        if n < 2:
            raise ProbeError(f"{self.data}: {n} token(s); perplexity needs at least two")
        model = load_model(Path(model_dir), "causal_lm", dev)
        length = max_positions(model, tok, self.max_length or 1024)
        if length < 2:
            raise ProbeError(f"perplexity: max_length {length} < 2")
        stride = min(self.stride or length, length)
        ids_t = torch.tensor(ids, dtype=torch.long)
        nll, count, prev_end = 0.0, 0, 0
        for begin in range(0, n, stride):
            end = min(begin + length, n)
            first = max(prev_end, begin + 1)  # absolute index of the first token scored here
            if first < end:
                window = ids_t[begin:end].to(dev)
                logits = model(input_ids=window[None]).logits[0]
                pred = logits[first - begin - 1:end - begin - 1].float()
                if not torch.isfinite(pred).all():
                    raise ProbeError("the model produced non-finite (NaN/Inf) logits")
                nll += float(torch.nn.functional.cross_entropy(pred, window[first - begin:], reduction="sum"))
                count += end - first
            prev_end = end
            if end == n:
                break
        mean = nll / count
        log.debug("probe=%s tokens=%d mean_nll=%.6f", self.name, count, mean)
        try:
            ppl = math.exp(mean)
        except OverflowError:
            ppl = math.inf
        return {self.metric: ppl}
