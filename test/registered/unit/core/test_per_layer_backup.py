"""PerLayerBackup, the pipeline alone (no SGLang): fake events, streams and copies that log
what happens, in order.

* each layer of a batch moves once, all held writes merged once at layer 0, after an event
  the write stream waits on; one ack with every ack id after the last layer, never before;
* a zero-owned rank copies nothing and still acks, at the same point;
* the ack carries the batch's timeline: layer 0 stored, layer 0 on host, the target's last
  layer stored, the last copy done (every rank, the draft's layers after the target's);
* with an MTP draft the draft's layers come after the target's, the ack after the draft's;
* a skipped layer, a late hold, a forward that ends or raises mid-way fail fast, naming the
  ack ids, the rank and the layers done; a repeated layer is ignored.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import pytest

from sglang_cp_hicache.core.per_layer_backup import BatchTimeline, PerLayerBackup, PerLayerBackupIncomplete

LAYERS = 3


@dataclass(frozen=True)
class Write:
    node_id: int
    owned_pages: Tuple[int, ...]  # this rank's pages of it (empty: owns none)


@dataclass(eq=False)
class FakeEvent:
    device: "FakeDevice"
    serial: int

    def record(self) -> None:
        stream = "write" if self.device.in_write_stream else "forward"
        self.device.log.append(("record", self.serial, stream))

    def wait(self, stream: str) -> None:
        self.device.log.append(("wait", self.serial, stream))


@dataclass
class FakeDevice:
    """Streams + transfers of one rank, logging in order; ``acks`` is the line's ack queue
    (all-layer acks are appended to it directly, as the controller's all-layer path does)."""

    log: list = field(default_factory=list)
    acks: List[Tuple[Optional[FakeEvent], Optional[FakeEvent], List[int]]] = field(default_factory=list)
    timelines: List[Tuple[Optional[Tuple[int, ...]], BatchTimeline]] = field(default_factory=list)
    merges: int = 0
    in_write_stream: bool = False
    _events: int = 0

    # BackupStreams
    def new_event(self) -> FakeEvent:
        self._events += 1
        return FakeEvent(self, self._events)

    @contextmanager
    def on_write_stream(self) -> Iterator[str]:
        self.in_write_stream = True
        try:
            yield "write-stream"
        finally:
            self.in_write_stream = False

    # LayerTransfers
    def merge(self, writes: Sequence[Write]) -> Optional[Tuple[int, ...]]:
        self.merges += 1
        owned = tuple(page for write in writes for page in write.owned_pages)
        return owned or None

    def copy_layer(self, transfer: Tuple[int, ...], layer_id: int) -> None:
        assert self.in_write_stream, "a copy outside the write stream"
        self.log.append(("copy", "target", layer_id, transfer))

    def copy_draft_layer(self, transfer: Tuple[int, ...], layer_id: int) -> None:
        assert self.in_write_stream, "a copy outside the write stream"
        self.log.append(("copy", "draft", layer_id, transfer))

    def keep_alive(self, transfer: Tuple[int, ...], stream: str) -> None:
        self.log.append(("keep_alive", stream))

    def ack(self, transfer: Optional[Tuple[int, ...]], ack_ids: List[int], timeline: BatchTimeline) -> None:
        self.acks.append((timeline.first_stored, timeline.finished, list(ack_ids)))
        self.timelines.append((transfer, timeline))

    def all_layer_ack(self, node_id: int) -> None:
        self.acks.append((None, None, [node_id]))

    def ack_ids(self) -> List[List[int]]:
        return [ids for _, _, ids in self.acks]

    def copies(self) -> List[Tuple[str, int]]:
        return [(entry[1], entry[2]) for entry in self.log if entry[0] == "copy"]


def make_pipeline(draft_layers: int = 0, rank: int = 0) -> Tuple[PerLayerBackup, FakeDevice]:
    device = FakeDevice()
    pipeline = PerLayerBackup(device, device, LAYERS, draft_layer_num=draft_layers, rank_label=f"CP rank {rank}")
    return pipeline, device


def run_forward(pipeline: PerLayerBackup, layers=range(LAYERS)) -> None:
    for layer in layers:
        pipeline.backup_layer(layer)
    pipeline.end_forward()


# ------------------------------------------------------------ one batch, one ack
def test_each_layer_moves_every_held_write_once_and_acks_once_after_the_last():
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, (10, 12)))
    pipeline.hold(Write(8, (11,)))
    assert device.log == [] and pipeline.held_ack_ids == [7, 8]
    for layer in range(LAYERS):
        pipeline.backup_layer(layer)
        assert device.copies() == [("target", l) for l in range(layer + 1)]
        if layer < LAYERS - 1:
            assert device.acks == []  # never per layer
    pipeline.end_forward()
    assert device.merges == 1  # layer 0 merged the held writes once
    assert {entry[3] for entry in device.log if entry[0] == "copy"} == {(10, 12, 11)}
    assert device.ack_ids() == [[7, 8]] and pipeline.held_ack_ids == []
    pipeline.backup_layer(0)  # the next forward, nothing held: nothing happens
    assert device.ack_ids() == [[7, 8]] and device.merges == 1


def test_the_write_stream_waits_for_each_layer_and_the_ack_event_follows_the_last_copy():
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, (10,)))
    run_forward(pipeline)
    first_layer = device.log[:3]
    assert first_layer == [("record", 1, "forward"), ("wait", 1, "write-stream"), ("copy", "target", 0, (10,))]
    start, finish, ids = device.acks[0]
    assert start.serial == 1 and ids == [7]  # the ack spans from layer 0's stores
    last_copy = device.log.index(("copy", "target", LAYERS - 1, (10,)))
    assert device.log[last_copy + 1 :] == [("record", finish.serial, "write"), ("keep_alive", "write-stream")]


def test_a_zero_owned_rank_copies_nothing_and_acks_at_the_same_point():
    owner, device_owner = make_pipeline(rank=0)
    bystander, device_bystander = make_pipeline(rank=1)
    owner.hold(Write(31, (4, 6)))
    bystander.hold(Write(31, ()))  # rank 1 owns none of node 31's pages
    for layer in range(LAYERS):
        owner.backup_layer(layer)
        bystander.backup_layer(layer)
        assert device_owner.ack_ids() == device_bystander.ack_ids()
    assert device_bystander.copies() == [] and device_owner.copies() == [("target", l) for l in range(LAYERS)]
    assert device_bystander.ack_ids() == [[31]]
    assert [e for e in device_bystander.log if e[0] == "keep_alive"] == []


def _records(device: FakeDevice) -> List[Tuple[int, str]]:
    """(event serial, stream) of every record, in order."""
    return [(entry[1], entry[2]) for entry in device.log if entry[0] == "record"]


@pytest.mark.parametrize("owned", [(10, 12), ()], ids=["owner", "zero-owned"])
def test_the_ack_carries_the_batch_timeline_in_the_order_the_events_were_recorded(owned):
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, owned))
    run_forward(pipeline)
    ((transfer, timeline),) = device.timelines
    assert transfer == (owned or None)
    records = _records(device)
    # layer 0 stored, layer 0 on host, layers 1..2 stored, the last copy done
    assert records[0] == (timeline.first_stored.serial, "forward")
    assert records[1] == (timeline.first_on_host.serial, "write")
    assert records[-2] == (timeline.last_stored.serial, "forward")
    assert records[-1] == (timeline.finished.serial, "write")
    assert len(records) == LAYERS + 2  # one per layer, layer 0 on host, the finish


def test_with_a_draft_the_timeline_s_last_stored_is_the_target_s_last_layer():
    pipeline, device = make_pipeline(draft_layers=1)
    pipeline.hold(Write(7, (1,)))
    run_forward(pipeline)
    target_last = _records(device)[-1]
    pipeline.backup_draft_layer(0)
    ((_, timeline),) = device.timelines
    assert (timeline.last_stored.serial, "forward") == target_last
    assert _records(device)[-1] == (timeline.finished.serial, "write")  # after the draft's copy


def test_an_all_layer_ack_appended_while_a_batch_is_held_or_mid_forward_comes_first():
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, (1,)))
    device.all_layer_ack(9)  # e.g. a hit-count backup
    pipeline.backup_layer(0)
    device.all_layer_ack(10)
    run_forward(pipeline, range(1, LAYERS))
    assert device.ack_ids() == [[9], [10], [7]]


def test_a_repeated_layer_notification_is_ignored():
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, (1,)))
    pipeline.backup_layer(0)
    pipeline.backup_layer(0)  # chunked-prefix MHA runs the attention twice per layer
    run_forward(pipeline, range(1, LAYERS))
    assert device.copies() == [("target", l) for l in range(LAYERS)]


# ------------------------------------------------------------------ fail fast
def test_a_skipped_layer_fails_fast_naming_ids_rank_and_layers_done():
    pipeline, device = make_pipeline(rank=2)
    pipeline.hold(Write(7, (1,)))
    pipeline.backup_layer(0)
    with pytest.raises(
        PerLayerBackupIncomplete,
        match=r"^CP rank 2: per-layer backups of nodes \[7\] incomplete \(1/3 layers submitted\): "
        r"the forward reported layer 2 after layer 0$",
    ):
        pipeline.backup_layer(2)
    assert pipeline.held_ack_ids == [] and device.acks == []  # dropped: never half-acked
    pipeline.end_forward()  # nothing left to report


def test_a_first_layer_other_than_zero_fails_fast():
    pipeline, _ = make_pipeline()
    pipeline.hold(Write(7, (1,)))
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[7\] .*0/3 layers.*layer 1 before layer 0"):
        pipeline.backup_layer(1)


def test_a_hold_while_a_forward_is_between_layers_fails_fast():
    pipeline, device = make_pipeline()
    pipeline.hold(Write(7, (1,)))
    pipeline.backup_layer(0)
    with pytest.raises(PerLayerBackupIncomplete, match=r"node 9 on CP rank 0: .*at layer 1"):
        pipeline.hold(Write(9, (2,)))
    run_forward(pipeline, range(1, LAYERS))  # the running batch is unharmed
    assert device.ack_ids() == [[7]]


@pytest.mark.parametrize("layers_done", [0, 1])
def test_a_forward_ending_or_raising_with_writes_left_fails_fast(layers_done):
    pipeline, _ = make_pipeline()
    pipeline.hold(Write(7, (1,)))
    pipeline.hold(Write(8, ()))
    for layer in range(layers_done):
        pipeline.backup_layer(layer)
    with pytest.raises(PerLayerBackupIncomplete, match=rf"nodes \[7, 8\] .*{layers_done}/3 layers.*forward ended"):
        pipeline.end_forward()
    pipeline.hold(Write(9, (1,)))
    error = RuntimeError("kernel failed")
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[9\].*raised") as info:
        pipeline.end_forward(error)
    assert info.value.__cause__ is error


# ---------------------------------------------------------------------- draft
def test_the_drafts_layers_come_after_the_targets_and_the_ack_after_the_drafts():
    pipeline, device = make_pipeline(draft_layers=2)
    pipeline.hold(Write(7, (3,)))
    pipeline.hold(Write(8, ()))
    run_forward(pipeline)  # the target forward ends: its batch waits for the draft forward
    assert device.acks == [] and pipeline.held_ack_ids == [7, 8]
    pipeline.draft_stage.backup_layer(0)
    assert device.acks == []
    pipeline.draft_stage.backup_layer(1)
    pipeline.draft_stage.end_forward()
    assert device.copies() == [("target", l) for l in range(LAYERS)] + [("draft", 0), ("draft", 1)]
    assert device.ack_ids() == [[7, 8]] and pipeline.held_ack_ids == []
    pipeline.draft_stage.backup_layer(0)  # a draft forward with nothing waiting: nothing
    assert len(device.copies()) == LAYERS + 2


def test_draft_out_of_order_or_missing_fails_fast():
    pipeline, _ = make_pipeline(draft_layers=2)
    pipeline.hold(Write(7, (3,)))
    run_forward(pipeline)
    with pytest.raises(
        PerLayerBackupIncomplete, match=r"3/3 layers submitted, not the draft's.*layer 1, expected layer 0 of 2"
    ):
        pipeline.draft_stage.backup_layer(1)
    pipeline.hold(Write(8, (3,)))
    run_forward(pipeline)
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[8\].*draft forward ended before storing its layer"):
        pipeline.draft_stage.end_forward()
    pipeline.hold(Write(9, (3,)))
    run_forward(pipeline)
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[9\].*before the draft forward stored its layer"):
        pipeline.hold(Write(10, (3,)))
    pipeline.hold(Write(11, (3,)))
    run_forward(pipeline)
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[11\].*a target forward started before the draft"):
        pipeline.backup_layer(0)


def test_reset_drops_every_stage():
    pipeline, device = make_pipeline(draft_layers=1)
    pipeline.hold(Write(7, (3,)))
    run_forward(pipeline)
    assert pipeline.held_ack_ids == [7]  # waiting for the draft forward
    pipeline.reset()
    assert pipeline.held_ack_ids == []
    pipeline.draft_stage.end_forward()  # nothing waits any more
    assert device.acks == []


def test_layer_counts_are_checked():
    device = FakeDevice()
    with pytest.raises(ValueError, match="0 target and 0 draft layers"):
        PerLayerBackup(device, device, 0)
