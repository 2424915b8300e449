"""Context parallelism: every sequence of a batch split over the ``cp_size`` ranks of a cp group.

chunks.py       which tokens of a row a cp rank holds (the load-balanced head-tail split)
split.py        ContextSplit: the share a DecoderModel runs on, cutting, gathering, the layout of a forward
ring.py         attention across the split: key/value blocks passed around the ring, merged by log-sum-exp
all_to_all.py   attention across the split: all-to-all between sequence and heads (Ulysses)
"""

from typing import Literal

# How attention reaches across the split (DistributedConfig.cp_mode).
ContextParallelMode = Literal["ring", "all_to_all"]
