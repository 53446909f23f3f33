"""Pipeline parallelism for any nn.Module: stage-to-stage transfers, the 1F1B schedules, the
zero-bubble ones (ZB-H1, ZBV) and DualPipeV."""

import importlib.metadata

from mega_pipeline.chunk import (
    DataIterator,
    ForwardStep,
    LossFunc,
    LossOutput,
    SplitBackward,
    StageChunk,
    WeightGradPass,
)
from mega_pipeline.dualpipe import dualpipev_order, dualpipev_pairs
from mega_pipeline.losses import broadcast_losses
from mega_pipeline.order import (
    Action,
    interleaved_order,
    interleaved_warmup,
    no_pipelining_order,
    one_f_one_b_order,
    peak_in_flight,
    validate_order,
)
from mega_pipeline.overlap import OverlappedForwardBackward
from mega_pipeline.p2p import P2PCommunicator
from mega_pipeline.plan import (
    Exchange,
    Message,
    Step,
    build_plan,
    simulate_plans,
    stage_rank,
    virtual_stage,
)
from mega_pipeline.schedules import (
    ForwardBackwardFunc,
    forward_backward_1f1b,
    forward_backward_interleaved,
    forward_backward_no_pipelining,
    forward_backward_zb_h1,
    get_forward_backward_func,
)
from mega_pipeline.stages import rank_layer_ranges, split_layers
from mega_pipeline.timed_plan import build_timed_plans, unit_times
from mega_pipeline.v_schedules import forward_backward_dualpipev, forward_backward_zbv
from mega_pipeline.zero_bubble import zb_h1_order, zbv_order, zbv_stage

try:
    __version__ = importlib.metadata.version("mega-pipeline")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Action",
    "DataIterator",
    "Exchange",
    "ForwardBackwardFunc",
    "ForwardStep",
    "LossFunc",
    "LossOutput",
    "Message",
    "OverlappedForwardBackward",
    "P2PCommunicator",
    "SplitBackward",
    "StageChunk",
    "Step",
    "WeightGradPass",
    "__version__",
    "broadcast_losses",
    "build_plan",
    "build_timed_plans",
    "dualpipev_order",
    "dualpipev_pairs",
    "forward_backward_1f1b",
    "forward_backward_dualpipev",
    "forward_backward_interleaved",
    "forward_backward_no_pipelining",
    "forward_backward_zb_h1",
    "forward_backward_zbv",
    "get_forward_backward_func",
    "interleaved_order",
    "interleaved_warmup",
    "no_pipelining_order",
    "one_f_one_b_order",
    "peak_in_flight",
    "rank_layer_ranges",
    "simulate_plans",
    "split_layers",
    "stage_rank",
    "unit_times",
    "validate_order",
    "virtual_stage",
    "zb_h1_order",
    "zbv_order",
    "zbv_stage",
]
