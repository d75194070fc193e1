"""The per-layer D2H backup pipeline: backups held for the next forward, moved to host one
layer at a time while that forward runs, one ack per batch after its last layer.

Stages, in order, each held by :class:`PerLayerBackup` alone::

    held writes --layer 0--> layer batch --last target layer--> draft batch --last draft layer--> ack
    (hold)                   (backup_layer, each layer once)    (only with an MTP draft:
                                                                 backup_draft_layer)

* **Layer 0** merges every held write's owned pages into one transfer, once
  (:meth:`LayerTransfers.merge`; None on a rank that owns none of them).
* **Each layer** records an event on the forward's stream (after that layer's stores), makes
  the write stream wait for it and copies the layer there (nothing on a zero-owned rank).
* **The ack.** A batch gets exactly one ack (:meth:`LayerTransfers.ack`), with every held
  ack id in hold order and the batch's :class:`BatchTimeline` (for the line's metrics),
  when its last layer is submitted: the target's last layer, or with an MTP draft the
  draft forward's last layer (the draft stores its KV after the target forward). Also on a rank that owns nothing: it still records the events. An all-layer
  backup acks when it is submitted, outside this class, so one submitted while a batch is
  held or mid-forward acks *before* that batch. Every rank reaches both points in the same
  program order (replicated scheduler, every rank runs every layer), so the ack queue is
  the same on every rank and a count-based pop after the line's one collective stays
  correct. This class runs no collective.
* **Fail fast.** A hold while a forward is between layers, a layer reported out of order
  (skipped, or before layer 0), a forward that ends or raises with writes held or mid-layers,
  and a draft forward that ends without its layers raise :class:`PerLayerBackupIncomplete`
  naming the ack ids, the rank and the layers done: their ack can no longer come, and
  waiting for it would hang every rank. A repeat of a layer already submitted is ignored
  (MHA with chunked prefix runs the attention more than once per layer).

Events and streams (:class:`BackupStreams`) and the copies (:class:`LayerTransfers`) are
injected: each SGLang line passes its own device module and host pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Generic, List, Optional, Protocol, Sequence, TypeVar


class PerLayerBackupIncomplete(RuntimeError):
    """A per-layer backup was left without all its layers: its ack would never come."""


class HeldWrite(Protocol):
    node_id: int  # the ack id: a node id, or a forward reservation's ticket


class BackupEvent(Protocol):
    def record(self) -> None:
        """Record on the current stream."""

    def wait(self, stream: Any) -> None:
        """Make ``stream`` wait until the recorded work is done."""


@dataclass(frozen=True)
class BatchTimeline:
    """One batch's events, for the line's metrics (all recorded by the time its ack is
    appended; timing events where the line's streams make them): ``first_stored`` after
    layer 0's stores (forward stream: the ack's start), ``first_on_host`` after layer 0's
    copy (write stream), ``last_stored`` after the target's last layer's stores (forward
    stream: where the forward's stores end) and ``finished`` after the batch's last copy
    (write stream: the ack's finish). On a rank that owns none of the pages the copies are
    empty and the events still recorded."""

    first_stored: BackupEvent
    first_on_host: BackupEvent
    last_stored: BackupEvent
    finished: BackupEvent


class BackupStreams(Protocol):
    """The device's events and its write stream (CUDA, a CPU stand-in, ...)."""

    def new_event(self) -> BackupEvent: ...

    def on_write_stream(self) -> ContextManager[Any]:
        """Make the write stream current inside; yields it."""


WriteT = TypeVar("WriteT", bound=HeldWrite)
TransferT = TypeVar("TransferT")  # one batch's merged owned pages (the line's type)


class LayerTransfers(Protocol[WriteT, TransferT]):
    """The line's mechanism: what one layer of a batch moves, and where its ack goes."""

    def merge(self, writes: Sequence[WriteT]) -> Optional[TransferT]:
        """This rank's owned pages of ``writes`` as one transfer; None when it owns none."""

    def copy_layer(self, transfer: TransferT, layer_id: int) -> None:
        """Queue the target's layer ``layer_id`` of ``transfer`` (write stream current)."""

    def copy_draft_layer(self, transfer: TransferT, layer_id: int) -> None:
        """Queue the MTP draft's layer ``layer_id`` of ``transfer`` (write stream current)."""

    def keep_alive(self, transfer: TransferT, stream: Any) -> None:
        """Keep ``transfer``'s index tensors alive until ``stream``'s work so far is done."""

    def ack(self, transfer: Optional[TransferT], ack_ids: List[int], timeline: BatchTimeline) -> None:
        """Append the batch's one write ack (``transfer``: what :meth:`merge` returned)."""


@dataclass
class LayerBatch(Generic[TransferT]):
    """The held writes of one forward, moved layer by layer as one transfer.

    ``ack_ids`` lists every write in hold order, also those this rank owns nothing of;
    ``transfer`` is this rank's owned pages of all of them (None: it owns none);
    ``next_layer`` layers went to the host, each once: target layers, then draft layers.
    """

    ack_ids: List[int]
    transfer: Optional[TransferT]
    start_event: Optional[BackupEvent] = None  # recorded after layer 0's stores
    first_on_host: Optional[BackupEvent] = None  # recorded after layer 0's copy
    last_stored: Optional[BackupEvent] = None  # recorded after the last target layer's stores
    next_layer: int = 0


class DraftStage:
    """The MTP draft pool's layer listener: its forward's layers go to the draft stage."""

    def __init__(self, pipeline: "PerLayerBackup") -> None:
        self._pipeline = pipeline

    def backup_layer(self, layer_id: int) -> None:
        self._pipeline.backup_draft_layer(layer_id)

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        self._pipeline.end_draft_forward(error)


class PerLayerBackup(Generic[WriteT, TransferT]):
    """Held writes, the running forward's layer batch and the batch waiting for the draft.

    ``layer_num``: target layers per forward; ``draft_layer_num``: layers of the MTP draft
    forward whose KV travels with the target's (0: no draft on host); ``rank_label`` names
    this rank in errors (e.g. ``"CP rank 1"``).
    """

    def __init__(
        self,
        transfers: LayerTransfers[WriteT, TransferT],
        streams: BackupStreams,
        layer_num: int,
        draft_layer_num: int = 0,
        rank_label: str = "rank 0",
    ) -> None:
        if layer_num < 1 or draft_layer_num < 0:
            raise ValueError(f"{layer_num} target and {draft_layer_num} draft layers")
        self._transfers = transfers
        self._streams = streams
        self.layer_num = layer_num
        self.draft_layer_num = draft_layer_num
        self.rank_label = rank_label
        self._held: List[WriteT] = []
        self._layer_batch: Optional[LayerBatch[TransferT]] = None
        self._draft_batch: Optional[LayerBatch[TransferT]] = None
        self.draft_stage = DraftStage(self)

    @property
    def held_ack_ids(self) -> List[int]:
        """Ack ids whose ack has not been appended: waiting for the draft, mid-forward, held."""
        waiting = self._draft_batch.ack_ids if self._draft_batch is not None else []
        started = self._layer_batch.ack_ids if self._layer_batch is not None else []
        return waiting + started + [write.node_id for write in self._held]

    def hold(self, write: WriteT) -> None:
        """Hold ``write`` for the next forward (before it starts; it must run every layer)."""
        if self._layer_batch is not None:
            raise PerLayerBackupIncomplete(
                f"node {write.node_id} on {self.rank_label}: per-layer backup submitted while "
                f"a forward is at layer {self._layer_batch.next_layer}; its earlier layers "
                "would never be backed up"
            )
        if self._draft_batch is not None:
            self._fail(
                f"node {write.node_id}'s per-layer backup was submitted for the next forward "
                "before the draft forward stored its layer"
            )
        self._held.append(write)

    def backup_layer(self, layer_id: int) -> None:
        """Layer ``layer_id``'s stores of the running forward are issued: move that layer of
        every held write (a no-op when nothing is held)."""
        batch = self._layer_batch
        if batch is None:
            if self._draft_batch is not None:  # the draft forward did not run in between
                self._fail("a target forward started before the draft forward stored its layer")
            if not self._held:
                return
            if layer_id != 0:
                self._fail(f"the forward reported layer {layer_id} before layer 0")
            held, self._held = self._held, []
            batch = self._layer_batch = LayerBatch([w.node_id for w in held], self._transfers.merge(held))
        if layer_id < batch.next_layer:
            return
        if layer_id > batch.next_layer:
            self._fail(f"the forward reported layer {layer_id} after layer {batch.next_layer - 1}")
        last_layer = layer_id == self.layer_num - 1
        acks_here = last_layer and not self.draft_layer_num  # else after the draft's layers
        self._submit_layer(batch, layer_id, acks_here, draft=False)
        if acks_here:
            self._layer_batch = None
        elif last_layer:  # every target layer is on its way: wait for the draft's
            self._draft_batch, self._layer_batch = batch, None

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        """The model forward returned or raised: nothing may be left held or mid-layers (a
        batch waiting for the draft forward is not, unless the forward raised)."""
        if self._held or self._layer_batch is not None or (error is not None and self._draft_batch is not None):
            self._fail("the model forward raised" if error is not None else "the model forward ended", error)

    def backup_draft_layer(self, layer_id: int) -> None:
        """The draft forward's layer ``layer_id`` stored its KV: move it for the batch whose
        target layers all went to the host, then (last draft layer) ack the batch. A no-op
        when no batch waits (a draft forward after a forward without per-layer backups)."""
        batch = self._draft_batch
        if batch is None:
            return
        expected = batch.next_layer - self.layer_num
        if layer_id != expected:
            self._fail(
                f"the draft forward reported layer {layer_id}, expected layer {expected} of "
                f"{self.draft_layer_num}"
            )
        last_layer = layer_id == self.draft_layer_num - 1
        self._submit_layer(batch, layer_id, last_layer, draft=True)
        if last_layer:
            self._draft_batch = None

    def end_draft_forward(self, error: Optional[BaseException] = None) -> None:
        """The draft forward returned or raised: the batch waiting for its layers cannot be
        left behind."""
        if self._draft_batch is not None:
            reason = "the draft forward raised" if error is not None else "the draft forward ended"
            self._fail(f"{reason} before storing its layer", error)

    def reset(self) -> None:
        """Drop everything (a flush: the line frees the host pages itself)."""
        self._held = []
        self._layer_batch = None
        self._draft_batch = None

    def _submit_layer(self, batch: LayerBatch[TransferT], layer_id: int, acks: bool, draft: bool) -> None:
        """Layer ``layer_id`` of ``batch`` (the target's, or ``draft``: the MTP draft's) to
        host on the write stream, after the stores the forward issued so far; with
        ``acks``, the batch's ack after the copy. Records the batch's timeline as it goes
        (:class:`BatchTimeline`)."""
        first = batch.start_event is None
        layer_stored = self._streams.new_event()
        layer_stored.record()  # on the forward's stream, after this layer's stores
        if first:
            batch.start_event = layer_stored
        if not draft and layer_id == self.layer_num - 1:
            batch.last_stored = layer_stored
        finish_event = self._streams.new_event() if acks else None
        with self._streams.on_write_stream() as write_stream:
            layer_stored.wait(write_stream)
            if batch.transfer is not None:
                copy = self._transfers.copy_draft_layer if draft else self._transfers.copy_layer
                copy(batch.transfer, layer_id)
            if first:
                batch.first_on_host = self._streams.new_event()
                batch.first_on_host.record()
            if acks:
                finish_event.record()
                if batch.transfer is not None:
                    self._transfers.keep_alive(batch.transfer, write_stream)
        batch.next_layer += 1
        if acks:
            timeline = BatchTimeline(batch.start_event, batch.first_on_host, batch.last_stored, finish_event)
            self._transfers.ack(batch.transfer, batch.ack_ids, timeline)

    def _fail(self, reason: str, error: Optional[BaseException] = None) -> None:
        """Drop the per-layer state and raise naming its ack ids: their acks can no longer
        come on this rank, so the ranks would diverge."""
        ack_ids = self.held_ack_ids
        if self._draft_batch is not None:
            layers = f"{self.layer_num}/{self.layer_num} layers submitted, not the draft's"
        else:
            done = self._layer_batch.next_layer if self._layer_batch is not None else 0
            layers = f"{done}/{self.layer_num} layers submitted"
        self.reset()
        raise PerLayerBackupIncomplete(
            f"{self.rank_label}: per-layer backups of nodes {ack_ids} incomplete ({layers}): {reason}"
        ) from error
