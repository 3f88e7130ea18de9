"""Flax models built from :class:`jaxsparse.nn.NMDense` (BERT first)."""

from jaxsparse.models.bert import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    load_minilm,
    mean_pool,
)

__all__ = ["BertConfig", "BertForSequenceClassification", "BertModel", "load_minilm", "mean_pool"]
