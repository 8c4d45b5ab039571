"""The statistics of the corpus being indexed or searched, set into a CK-QTI checkpoint's explicit match
(Eq. 9–10), as BM25 takes its IDF and average length from the collection it searches: a checkpoint trained
on one collection scores another with that collection's own IDF and mean document length
(:class:`CorpusAdaptation`), and a document read in several windows is normalised by the mean length read
(:func:`document_length_scale`)."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckray.data import statistics
from ckray.data.statistics import has_corpus
from ckray.rankers.ck_qti.impact_settings import ImpactConfig, check_ck_qti_checkpoint

log = logging.getLogger(__name__)


def cached_corpus_statistics(workdir: str | os.PathLike, config: Any, classes: np.ndarray | None = None):
    """``ckray.data.statistics.cached_corpus_statistics`` of ``workdir``'s corpus, tokenised as the
    CK-QTI ``config``'s encoder and ``max_doc_len`` do, document frequencies counted over the exact-match
    ``classes`` when given (``CKModel.match_classes``)."""
    from ckray.rankers.ck_qti.model import piece_tokenisation

    return statistics.cached_corpus_statistics(workdir, piece_tokenisation(config), classes)


def training_mean_doc_len(checkpoint: str | os.PathLike, model: Any) -> float | None:
    """The mean document length of the corpus ``model`` was trained on: recorded with the checkpoint
    (``ckray.deploy``, ``corpus``), else that of the work directory the checkpoint lies in
    (``<W>/checkpoints/<name>``) when its corpus reproduces the checkpoint's IDF exactly; else None."""
    import torch

    from ckray.deploy import read_deploy

    recorded = read_deploy(checkpoint).get("corpus") or {}
    if "mean_doc_len" in recorded:
        return float(recorded["mean_doc_len"])
    home = Path(checkpoint).resolve().parent.parent
    if not has_corpus(home):
        return None
    stats = cached_corpus_statistics(home, model.config, model.match_classes())
    if torch.equal(model.idf_of(stats.doc_freq, stats.n_docs), model.idf.cpu()):
        return stats.mean_doc_len
    return None


@dataclass
class CorpusAdaptation:
    """The explicit match (Eq. 9) of a checkpoint set to the statistics of the corpus being indexed, as
    BM25 takes its IDF and average length from the collection it searches: IDF from the target's
    document frequencies, and the running E[|d|] of Eq. 10 multiplied by ``length_scale`` = the target's
    mean length over the training corpus's, so |d| is normalised relative to the target's average as
    it was to the training corpus's. On the training corpus nothing changes (``changed`` is False)."""

    doc_freq: np.ndarray | None = None   # None: IDF as trained
    n_docs: int = 0
    length_scale: float = 1.0
    mean_doc_len: float = 0.0

    @property
    def changed(self) -> bool:
        return self.doc_freq is not None or self.length_scale != 1.0

    def apply(self, model: Any) -> Any:
        """Set ``model``'s IDF and E[|d|] (in place); returns it."""
        import torch

        if self.doc_freq is not None:
            model.set_idf(torch.as_tensor(np.array(self.doc_freq)), self.n_docs)   # a copy: Ray passes it read-only
        if self.length_scale != 1.0:
            with torch.no_grad():
                model.bs_len.running_mean.mul_(self.length_scale)
        return model

    def stamp(self) -> dict:
        """What shard stamps record: nothing when the statistics are the training corpus's (stamps of
        indexes built before stay valid), else the target's statistics."""
        if not self.changed:
            return {}
        df = hashlib.sha256(np.ascontiguousarray(self.doc_freq).tobytes()).hexdigest() if self.doc_freq is not None else None
        return {"corpus_statistics": {"n_docs": self.n_docs, "doc_freq_sha256": df, "mean_doc_len": self.mean_doc_len,
                                      "length_scale": self.length_scale}}


def corpus_adaptation(workdir: str | os.PathLike, checkpoint: str | os.PathLike, model: Any = None) -> CorpusAdaptation:
    """How ``checkpoint``'s explicit match is set for ``workdir``'s corpus (:class:`CorpusAdaptation`).
    The target's IDF replaces the checkpoint's when they differ; its mean length rescales E[|d|] when
    the training corpus's is known (:func:`training_mean_doc_len`; else lengths stay as trained, logged)."""
    import torch

    from ckray.rankers.ck_qti.model import load_ck_model

    model = model if model is not None else load_ck_model(checkpoint)
    target = cached_corpus_statistics(workdir, model.config, model.match_classes())
    if torch.equal(model.idf_of(target.doc_freq, target.n_docs), model.idf.cpu()):
        return CorpusAdaptation(mean_doc_len=target.mean_doc_len)
    source_len = training_mean_doc_len(checkpoint, model)
    if source_len is None:
        log.warning("%s: the mean document length of its training corpus is not known; IDF is taken from %s, "
                    "length normalisation stays as trained", checkpoint, workdir)
    scale = target.mean_doc_len / source_len if source_len else 1.0
    log.info("CK-QTI explicit match set to %s's corpus: IDF of %d documents, mean length %.1f (training %s)",
             workdir, target.n_docs, target.mean_doc_len, f"{source_len:.1f}" if source_len else "unknown")
    return CorpusAdaptation(doc_freq=target.doc_freq.numpy(), n_docs=target.n_docs, length_scale=scale,
                            mean_doc_len=target.mean_doc_len)


def document_length_scale(workdir: str | os.PathLike, checkpoint: str | os.PathLike, config: ImpactConfig,
                          corpus: CorpusAdaptation) -> float:
    """``TermImpactScorer.document_length_scale`` for ``workdir``'s corpus: its mean length in word pieces
    counted over each document's first window (``corpus.mean_doc_len``, what Eq. 10's E[|d|] was set to)
    over its mean counted over every window read (at most ``config.passages``; cached in ``W/statistics``),
    as BM25 normalises |d| by the mean length of the documents it searches. 1 when the exact-match score
    is counted per window (``config.explicit_over_documents`` false)."""
    from ckray.models.encoders import passage_overlap
    from ckray.rankers.ck_qti.model import CKConfig, piece_tokenisation

    if not config.explicit_over_documents:
        return 1.0
    model = CKConfig(**check_ck_qti_checkpoint(checkpoint)["config"])
    window = config.window_pieces or model.max_doc_len
    read = window + (config.passages - 1) * (window - passage_overlap(window)) if config.passages else 2 ** 31 - 1
    read = max(read, model.max_doc_len)   # a document that fits one window of max_doc_len is read whole
    whole = statistics.cached_corpus_statistics(workdir, piece_tokenisation(model, read))
    return corpus.mean_doc_len / whole.mean_doc_len if whole.mean_doc_len else 1.0
