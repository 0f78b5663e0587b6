"""The popular articles whose wrong claims some questions correct (a question's `article_claim`
names one by its key here), cited as a learner can find them: by title and author.

    cite("tummala-module-3")    # "Gopi Krishna Tummala's article on distributed training ..."
"""
from __future__ import annotations

# key -> how the quiz cites the article (its title as published, and its author where the
# article names one)
ARTICLES = {
    "mage-7b-70b": "\u201cHow to Pick the Right Parallelism for 7B-70B Models: DP, TP, PP, ZeRO "
                   "& FSDP\u201d by MaGe Linux Operations",
    "train-70b-plus": "\u201cDistributed Training: How to Train 70B+ Parameter Models\u201d (the "
                      "article names no author)",
    "tummala-module-3": "Gopi Krishna Tummala's article on distributed training (module 3 of "
                        "his series, after \u201cDataloaders\u201d)",
    "dadops-benchmarks": "\u201cDistributed Training Benchmarks: Data Parallel, Model Parallel, "
                         "and Pipeline Parallel Compared\u201d on the DadOps blog",
    "engineersofai-strategies": "\u201cDistributed Training Strategies\u201d by EngineersOfAI",
}


def cite(key: str) -> str:
    """How the quiz names article `key`; ValueError listing the keys for any other."""
    if key not in ARTICLES:
        raise ValueError(f"article={key!r} is not a known article; allowed: "
                         f"{', '.join(ARTICLES)}")
    return ARTICLES[key]
