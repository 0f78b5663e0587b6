"""The popular articles whose wrong claims some questions correct (a question's `article_claim`
names one by its key here), cited as a learner can find them: by title and author.

    cite("tummala-module-3")    # "Gopi Krishna Tummala's article on distributed training ..."
    labkit.quiz.bank.claim_attempt(get("hw-nvlink-bidirectional-seed"))   # drawn at the claim's own link

A question draws its parameters afresh; where an article's claim states some of them (H100's
NVLink 4, 2 interleaved chunks), `CLAIM_PARAMS` holds them, so the answer printed beside the
claim is the answer to the claim's own case.
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

# question id -> the parameters its article claim states (the rest are the claim's whatever
# they are drawn as: the claim is general, or every value of the list is one it quotes)
CLAIM_PARAMS = {
    "hw-network-port-gbps": {"link": "ib-ndr"},           # "400 GB/s": NDR's 400 Gb/s
    "hw-nvlink-bidirectional-seed": {"link": "nvlink4"},  # "on H100 NVLink 4.0"
    "hw-nvlink-vs-ib-seed": {"fast": "nvlink4", "slow": "ib-hdr"},   # H100 vs HDR
    "mem-model-states-unsharded": {"precision": "fp16-mixed"},       # "params(fp16)"
    "pp-interleaving-cost": {"chunks": 2},                # "halves the bubble"
    "pp-naive-utilisation": {"stages": 8},                # "8 GPUs: only 1/8"
    "zero-pipeline-deepspeed-seed": {"stage": 3},         # "stage: 3"
}


def claim_params(question) -> dict:
    """The parameters of `question` at its article claim: its seed-0 draw, with the values the
    claim states (`CLAIM_PARAMS`) put in; ValueError for a value the question cannot draw."""
    return claim_draw(question)[0]


def claim_draw(question):
    params, rng = question._draw(0)       # the seed-0 generator: options in seed 0's order
    for name, value in CLAIM_PARAMS.get(question.id, {}).items():
        if value not in question.params.get(name, ()):
            raise ValueError(f"{question.id}: the claim's {name}={value!r} is not one the "
                             f"question draws; allowed: {question.params.get(name, [])}")
        params[name] = value
    return params, rng


def cite(key: str) -> str:
    """How the quiz names article `key`; ValueError listing the keys for any other."""
    if key not in ARTICLES:
        raise ValueError(f"article={key!r} is not a known article; allowed: "
                         f"{', '.join(ARTICLES)}")
    return ARTICLES[key]
