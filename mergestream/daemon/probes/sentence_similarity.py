"""``sentence_similarity``: an encoder's general-knowledge probe (STS-style Spearman).

Metric ``sts_spearman`` (renamed by ``metric``): 100 × Spearman correlation between the cosine
similarity of the two sentences' mean-pooled embeddings and the gold scores of a TSV file with
header ``score<TAB>text<TAB>text2`` (read with :mod:`csv`, standard double-quote quoting), in
[-100, 100]. The math is :func:`mergestream.datasteps.text.sts_spearman`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ...datasteps.text import load_model, read_scored_pairs, sts_spearman
from .base import ProbeContext, ProbeError, data_file, positive_int, probe_device, tokenizer_for

log = logging.getLogger(__name__)


class SentenceSimilarityProbe:
    """General-knowledge probe of an encoder: STS-style Spearman correlation.

    Embeds both sentences of each pair (attention-masked mean of the last hidden state), takes the
    cosine similarity, and reports 100 × Spearman(cosines, gold scores) under ``metric``. A
    correlation that is undefined (all cosines equal, e.g. a collapsed model) is reported as 0.0.

    Args:
        data: TSV file with header ``score<TAB>text<TAB>text2``.
        metric: metric name (default ``sts_spearman``).
        max_pairs: use the first N pairs (default all).
        batch_size: sentences per forward pass.
        max_length: truncation length in tokens (capped by the model's positions).
        name: probe name (default ``sentence_similarity``).

    Raises:
        ProbeError: missing data file or bad parameters; at call time a malformed file, fewer than
            two pairs, no tokenizer, an unloadable model or non-finite embeddings.
    """

    def __init__(self, data: str | Path | None = None, metric: str = "sts_spearman", max_pairs: int | None = None,
                 batch_size: int = 32, max_length: int = 128, name: str = "sentence_similarity"):
        self.data = data_file(data, "sentence_similarity")
        self.metric = metric
        self.max_pairs = positive_int(max_pairs, "sentence_similarity: max_pairs")
        self.batch_size = positive_int(batch_size, "sentence_similarity: batch_size", allow_none=False)
        self.max_length = positive_int(max_length, "sentence_similarity: max_length", allow_none=False)
        self.name = name

    def __call__(self, model_dir: Path, ctx: ProbeContext) -> dict[str, float]:
        """Returns ``{metric: 100 × Spearman}`` in [-100, 100]."""
        rows = read_scored_pairs(self.data, self.max_pairs)
        if len(rows) < 2:
            raise ProbeError(f"{self.data}: need at least two scored pairs, got {len(rows)}")
        dev = probe_device(ctx)
        tok = tokenizer_for(Path(model_dir), ctx)
        model = load_model(Path(model_dir), "encoder", dev)
        rho = sts_spearman(model, tok, rows, batch_size=self.batch_size, max_length=self.max_length, device=dev)
        if math.isnan(rho):
            log.warning("probe=%s metric=%s undefined correlation (constant cosines); reporting 0.0",
                        self.name, self.metric)
            rho = 0.0
        return {self.metric: rho}
