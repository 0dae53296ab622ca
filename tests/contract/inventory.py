"""Every private name and behaviour of Faust, mode and aiokafka that Rebound relies on, in one place.

Rebound's consumer layer (``app/consumer.py``, ``agents/dispatcher.py``), its tables (``tables/``) and a few views read,
override or assign names these libraries do not promise to keep. ``test_faust_contract.py`` checks each entry against
the installed releases and fails with the entry's name and its ``why``, so an upgrade that changes one fails here, in
one place, rather than quietly in the commit path. A private name used in those files and missing here fails
``test_every_private_name_used_is_in_the_inventory``: add it here with the reason, and a check.

docs/upgrading.md says what to do when an entry fails.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """A method Rebound overrides or calls: it must exist with these parameters (after ``self``), async or not."""

    owner: str
    name: str
    params: tuple[str, ...]
    is_async: bool
    why: str


@dataclass(frozen=True)
class Attribute:
    """An attribute Rebound reads or assigns: some class of ``owner``'s MRO must assign ``self.<name>`` (or declare it)."""

    owner: str
    name: str
    why: str


@dataclass(frozen=True)
class ModuleName:
    """A name Rebound imports from a module (private ones included)."""

    module: str
    name: str
    why: str


@dataclass(frozen=True)
class Behaviour:
    """Something Rebound relies on that a name check cannot see; ``test_behaviour_<key>`` checks it."""

    key: str
    why: str


CONSUMER = "faust.transport.consumer.Consumer"
THREAD_DELEGATE = "faust.transport.consumer.ThreadDelegateConsumer"
DRIVER_CONSUMER = "faust.transport.drivers.aiokafka.Consumer"
DRIVER_THREAD = "faust.transport.drivers.aiokafka.AIOKafkaConsumerThread"
AIOKAFKA_CONSUMER = "aiokafka.consumer.consumer.AIOKafkaConsumer"
COORDINATOR = "aiokafka.consumer.group_coordinator.GroupCoordinator"
TABLE = "faust.tables.base.Collection"
ROCKSDB_STORE = "faust.stores.rocksdb.Store"
RECOVERY = "faust.tables.recovery.Recovery"
SERVICE = "mode.services.Service"
WORKER = "mode.worker.Worker"
FLOW_CONTROL = "mode.utils.queues.FlowControlEvent"

METHODS: tuple[Method, ...] = (
    # -- overridden by app/consumer.py's ReboundConsumer
    Method(
        CONSUMER,
        "_new_offset",
        ("tp",),
        False,
        "app/consumer.py overrides it: commits start at the committed "
        "offset and run over acknowledged offsets and confirmed gaps only (faust-streaming issue 606)",
    ),
    Method(
        CONSUMER,
        "_filter_committable_offsets",
        ("tps",),
        False,
        "app/consumer.py overrides it: only assigned partitions' acknowledged offsets are taken for a commit (Faust's "
        "_commit_offsets discards the others after _new_offset took them: a revocation that reads no assignment lost "
        "its finished offsets); Faust's commit() reaches _new_offset only through it",
    ),
    Method(
        CONSUMER,
        "_commit_offsets",
        ("offsets", "start_new_transaction"),
        True,
        "app/consumer.py overrides it to tell the read cursors what the broker stored; Faust's flushes the app's "
        "producer first, whose flush app/producer.py bounds",
    ),
    Method(
        CONSUMER,
        "_drain_messages",
        ("fetcher",),
        True,
        "app/consumer.py replaces Faust's fetch loop: the read cursors decide what a jump in offsets means",
    ),
    Method(
        CONSUMER,
        "ack",
        ("message",),
        False,
        "app/consumer.py overrides it to refuse the ack of a message no "
        "stream tracked; the dispatcher acknowledges through it",
    ),
    Method(
        CONSUMER, "stop_flow", (), False, "app/consumer.py overrides it: queued work is dropped when the flow stops"
    ),
    Method(
        DRIVER_THREAD,
        "_fetch_records",
        ("consumer", "active_partitions", "timeout", "max_records"),
        True,
        "app/consumer.py's ReboundConsumerThread overrides it to install the fetch guard and free partitions "
        "that decode again",
    ),
    Method(CONSUMER, "resume_flow", (), False, "app/consumer.py overrides it: records a resume cleared are read again"),
    Method(
        CONSUMER,
        "resume_partitions",
        ("tps",),
        False,
        "app/consumer.py overrides it: a held topic stays paused through Faust's resumes",
    ),
    Method(
        CONSUMER, "pause_partitions", ("tps",), False, "app/consumer.py pauses partitions for back-pressure and holds"
    ),
    Method(
        CONSUMER,
        "on_buffer_drop",
        ("tp",),
        False,
        "app/consumer.py overrides it: a paused partition stays paused when its stream queue drains",
    ),
    Method(
        CONSUMER, "perform_seek", (), True, "app/consumer.py overrides the recovery's seek to the committed offsets"
    ),
    Method(CONSUMER, "seek", ("partition", "offset"), True, "app/consumer.py overrides it to move the read cursor"),
    Method(
        CONSUMER,
        "_seek",
        ("partition", "offset"),
        True,
        "app/consumer.py overrides it to seek through the consumer thread's method queue",
    ),
    Method(
        CONSUMER,
        "on_partitions_revoked",
        ("revoked",),
        True,
        "app/consumer.py overrides it to keep acknowledgements through the app's revocation commit",
    ),
    Method(
        CONSUMER,
        "on_partitions_assigned",
        ("assigned", "generation_id"),
        True,
        "app/consumer.py overrides it to forget the offsets it finished on partitions the group did not give back, and "
        "all of them unless generation_id is the one right after theirs",
    ),
    Method(
        CONSUMER,
        "_is_changelog_tp",
        ("tp",),
        False,
        "app/consumer.py tells changelogs (Faust's reading) from acknowledged topics",
    ),
    Method(
        CONSUMER,
        "_add_gap",
        ("tp", "offset_from", "offset_to"),
        True,
        "app/consumer.py records gaps of changelogs and unacknowledged topics as Faust does",
    ),
    Method(
        CONSUMER, "_get_active_partitions", (), False, "app/consumer.py reads and fills the set the next fetch uses"
    ),
    Method(CONSUMER, "seek_to_committed", (), True, "app/consumer.py's perform_seek starts from it"),
    Method(
        CONSUMER,
        "maybe_wait_for_commit_to_finish",
        (),
        True,
        "app/consumer.py waits for a commit in flight before its revocation commit",
    ),
    Method(
        CONSUMER,
        "commit",
        ("topics", "start_new_transaction"),
        True,
        "app/consumer.py commits every _commit_every acks and before a revocation",
    ),
    Method(
        CONSUMER,
        "verify_event_path",
        ("now", "tp"),
        False,
        "app/consumer.py overrides it: a held topic is not fetched on purpose",
    ),
    Method(THREAD_DELEGATE, "_new_consumer_thread", (), False, "app/consumer.py makes its own consumer thread"),
    Method(THREAD_DELEGATE, "earliest_offsets", ("partitions",), True, "app/consumer.py reads log starts"),
    Method(DRIVER_CONSUMER, "_new_offset", ("tp",), False, "app/consumer.py calls super()._new_offset for changelogs"),
    # -- the consumer thread
    Method(
        DRIVER_THREAD,
        "on_start",
        (),
        True,
        "app/consumer.py's ReboundConsumerThread watches the heartbeats once it has started aiokafka's consumer",
    ),
    Method(
        DRIVER_THREAD,
        "on_partitions_assigned",
        ("assigned", "generation_id"),
        True,
        "app/consumer.py's ReboundConsumerThread renews the session lease at each join (aiokafka's listener calls "
        "it once SyncGroup answered, before the heartbeats start again) and, first thing, ends the ownership window a "
        "revocation opened (ReboundConsumer.assignment_handed_over: between_assignments, and _kept_from for late "
        "acks)",
    ),
    Method(
        DRIVER_THREAD,
        "_create_worker_consumer",
        ("transport",),
        False,
        "app/consumer.py overrides it to set "
        "consumer options Faust hard-codes (fetch_max_wait_ms, the isolation level)",
    ),
    Method(
        DRIVER_THREAD,
        "_fetch_records",
        ("consumer", "active_partitions", "timeout", "max_records"),
        True,
        "app/consumer.py overrides it to guard the fetcher against a batch that cannot be decoded",
    ),
    Method(
        "aiokafka.consumer.fetcher.PartitionRecords",
        "_unpack_records",
        (),
        False,
        "the records generator: it reads PartitionRecords._records on its first step (not when the object is made), "
        "so app/fetch_guard.py can swap in a record set that remembers the last batch it handed out",
    ),
    Method(DRIVER_THREAD, "_ensure_consumer", (), False, "app/consumer.py reads the aiokafka consumer through it"),
    Method(DRIVER_THREAD, "seek", ("partition", "offset"), False, "app/consumer.py seeks through the thread"),
    Method(
        "mode.threads.QueueServiceThread",
        "call_thread",
        ("fun", "args", "kwargs"),
        True,
        "app/consumer.py runs seeks, committed() and positions in the consumer thread's loop",
    ),
    # -- aiokafka
    Method(AIOKAFKA_CONSUMER, "committed", ("partition",), True, "app/consumer.py asks the broker's committed offset"),
    Method(
        COORDINATOR, "check_errors", (), False, "app/consumer.py hands the coordinator the 'error seen' it waits for"
    ),
    Method(
        COORDINATOR,
        "_do_heartbeat",
        (),
        True,
        "app/consumer.py's ReboundConsumerThread.watch_heartbeats wraps it on the coordinator (the heartbeat task "
        "looks it up per beat; True: still a member) to renew the session lease agents/dispatcher.py waits on "
        "before starting a queued record; without it a worker woken after its eviction runs its queue twice",
    ),
    Method(
        COORDINATOR,
        "_send_req",
        ("request",),
        True,
        "app/consumer.py's ReboundConsumerThread.watch_heartbeats wraps it on the coordinator to note when a join's "
        "SyncGroup is sent (CoordinatorGroupRebalance sends it through the coordinator's _send_req): the join renews "
        "the session lease from then, not from when the answer was read",
    ),
    Method(
        "aiokafka.consumer.subscription_state.Assignment",
        "state_value",
        ("tp",),
        False,
        "app/consumer.py reads fetch positions without consuming a coordinator error",
    ),
    Method(
        "aiokafka.client.AIOKafkaClient",
        "force_metadata_update",
        (),
        False,
        "agents/readers.py waits for a topic's partitions",
    ),
    Method(
        "aiokafka.client.AIOKafkaClient",
        "_wait_on_metadata",
        ("topic",),
        True,
        "app/views.py fetches the changelog's metadata before routing a table view",
    ),
    Method(
        "faust.transport.drivers.aiokafka.Producer",
        "flush",
        (),
        True,
        "app/producer.py's ReboundProducer overrides it with a flush bounded to what the producer holds when called, "
        "and falls back to it (super()): in a transaction, and for a buffer that is not running",
    ),
    Method(
        "faust.transport.drivers.aiokafka.Producer",
        "_ensure_producer",
        (),
        False,
        "app/views.py reaches the aiokafka producer's client; agents/delivery.py sends attempt events straight to it",
    ),
    Method(
        "faust.app.router.Router",
        "_route_req",
        ("dest_url", "web", "request"),
        True,
        "app/views.py route_to_partition forwards a key view or admin action named with ?partition=N to the worker "
        "actively owning partition N (behaviour router_forwards_to_the_active_owner_of_a_table_partition)",
    ),
    # -- the app and its tables
    Method("faust.app.base.App", "_new_transport", (), False, "app/consumer.py's ReboundApp plugs its transport in"),
    Method("faust.app.base.App", "on_start", (), True, "app/consumer.py's ReboundApp holds topics from the start"),
    Method(
        "faust.app.base.App",
        "_on_partitions_revoked",
        ("revoked",),
        True,
        "app/consumer.py's ReboundApp stops the flow, waits for the streams and flushes the producer itself when "
        "Faust's revocation skips them, the consumer reading no assignment (behaviours "
        "app_revocation_stops_the_flow_only_with_an_assignment, a_resubscription_s_revocation_reads_no_assignment)",
    ),
    Method(
        "faust.app.base.App",
        "_producer_flush",
        ("logger",),
        True,
        "app/consumer.py's ReboundApp flushes the producer after the streams, as Faust's revocation does, where Faust's "
        "skips it (no assignment)",
    ),
    Method(
        "faust.app.base.App",
        "on_started",
        (),
        True,
        "app/consumer.py's ReboundApp drops the unprinted debug level once started (app/log_levels.py)",
    ),
    Method(
        "faust.app.base.App",
        "FlowControlQueue",
        ("maxsize", "clear_on_resume"),
        False,
        "every stream queue is made here with the app's flow_control: ReboundApp's counting flow control "
        "(app/consumer.py) sees their clears only because of that (see behaviours)",
    ),
    Method(
        "mode.utils.queues.FlowControlEvent",
        "clear",
        (),
        False,
        "app/consumer.py's CountingFlowControl overrides it to count the clears of the stream queues; resume() must "
        "go through it (see behaviours)",
    ),
    Method(
        "mode.utils.queues.FlowControlEvent",
        "resume",
        (),
        False,
        "Faust's recovery clears the stream queues through it; CountingFlowControl counts that clear",
    ),
    Method(
        DRIVER_THREAD,
        "getmany",
        ("active_partitions", "timeout"),
        True,
        "ReboundConsumerThread._fetch_records guards what it fetches (undecodable batches, transaction holes): "
        "getmany must go through _fetch_records",
    ),
    # -- overridden by app/shutdown.py's ReboundWorker
    Method(
        WORKER,
        "_schedule_shutdown",
        ("signal",),
        False,
        "app/shutdown.py arms the shutdown watchdog on the first stop signal, then calls mode's, which schedules the "
        "stop once (it sets _signal_stop_time)",
    ),
    Method(
        WORKER,
        "install_signal_handlers",
        (),
        False,
        "app/shutdown.py wraps mode's signal handlers so that a signal arms the watchdog before anything logs",
    ),
    Method(
        WORKER,
        "on_worker_shutdown",
        (),
        False,
        "app/shutdown.py arms the watchdog on every way out of the worker, a crash's too",
    ),
    Method(
        WORKER, "stop_and_shutdown", (), False, "app/shutdown.py disarms the watchdog once the worker's stop completed"
    ),
    Method(TABLE, "_on_changelog_sent", ("fut",), False, "tables/fencing.py's send_changelog keeps Faust's callback"),
    Method(TABLE, "_new_store_by_url", ("url",), False, "tables/rocksdb_tuning.py wraps it to tune the store"),
    Method(
        TABLE,
        "send_changelog",
        ("partition", "key", "value", "key_serializer", "value_serializer"),
        False,
        "tables/fencing.py replaces it on the table to stamp writer epochs",
    ),
    Method(TABLE, "apply_changelog_batch", ("batch",), False, "tables/fencing.py replaces it to skip fenced records"),
    Method(TABLE, "persisted_offset", ("tp",), False, "tables/fencing.py replaces it: recovery's starting point"),
    Method(
        TABLE,
        "on_changelog_event",
        ("event",),
        True,
        "tables/fencing.py replaces it: a record fetched before a rebalance is given back to the replay",
    ),
    Method(
        TABLE,
        "on_recovery_completed",
        ("active_tps", "standby_tps"),
        True,
        "tables/fencing.py wraps it to claim writer epochs",
    ),
    Method(
        ROCKSDB_STORE,
        "_db_for_partition",
        ("partition",),
        False,
        "tables/fencing.py reads and writes one partition's database",
    ),
    Method(ROCKSDB_STORE, "_get", ("key",), False, "tables/retry_state.py reads a key in one lookup (None: absent)"),
    Method(ROCKSDB_STORE, "_encode_key", ("key",), False, "tables/retry_state.py encodes a key as the table would"),
    Method(ROCKSDB_STORE, "_decode_value", ("value",), False, "tables/retry_state.py decodes what _get returned"),
    Method(RECOVERY, "active_remaining", (), False, "tables/fencing.py claims only partitions read to the end"),
    Method(RECOVERY, "on_recovery_completed", ("generation_id",), True, "its order is relied on (see behaviours)"),
    Method(RECOVERY, "_resume_streams", ("generation_id",), True, "its order is relied on (see behaviours)"),
)

ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        "faust.sensors.monitor.Monitor",
        "stream_inbound_time",
        "app/consumer.py's StreamInboundTime keeps it once the Monitor is out of the per-event sensors; Faust's livelock "
        "detector (verify_event_path) reads it; agents/livelock.py writes it when a pause or the breaker's hold ends",
    ),
    Attribute(
        CONSUMER,
        "_acked",
        "app/consumer.py's _new_offset and revocation read and keep the acked offsets; a revocation remembers what is "
        "left in it",
    ),
    Attribute(
        CONSUMER,
        "_acked_index",
        "app/consumer.py's _new_offset and revocation keep it with _acked; a record read again whose offset is in it "
        "is not handed over again (_skip_if_finished)",
    ),
    Attribute(CONSUMER, "_gap", "app/consumer.py records confirmed gaps in Faust's interval trees"),
    Attribute(
        CONSUMER,
        "_committed_offset",
        "app/consumer.py's commit floor; agents/metrics.py's lag; the dispatcher's log lines (a refused ack, a revocation)",
    ),
    Attribute(CONSUMER, "_read_offset", "app/consumer.py moves it with every record handed over"),
    Attribute(CONSUMER, "_unacked_messages", "app/consumer.py's abandon() lets go of a dropped message"),
    Attribute(CONSUMER, "_waiting_for_ack", "app/consumer.py wakes Faust's wait_empty after abandon()"),
    Attribute(
        CONSUMER,
        "_n_acked",
        "app/consumer.py commits every _commit_every acks, as Faust's loop does",
    ),
    Attribute(CONSUMER, "_commit_every", "app/consumer.py commits every _commit_every acks, as Faust's loop does"),
    Attribute(CONSUMER, "_paused_partitions", "app/consumer.py's on_buffer_drop keeps paused partitions paused"),
    Attribute(CONSUMER, "_buffered_partitions", "app/consumer.py's on_buffer_drop takes a partition out of it"),
    Attribute(
        "mode.utils.queues.FlowControlQueue",
        "_pending_pressure_drop_callbacks",
        "app/consumer.py's _share_stream_queues ends Faust's buffer-full pause once a stream queue has room",
    ),
    Attribute(CONSUMER, "_on_partitions_revoked", "app/consumer.py wraps the app's revocation callback"),
    Attribute(CONSUMER, "flow_active", "app/consumer.py hands nothing over while the flow is stopped"),
    Attribute(CONSUMER, "callback", "app/consumer.py's _deliver awaits the conductor's callback directly"),
    Attribute(THREAD_DELEGATE, "_thread", "app/consumer.py and agents/metrics.py reach the consumer thread"),
    Attribute(DRIVER_THREAD, "_consumer", "app/consumer.py and agents/metrics.py reach the aiokafka consumer"),
    Attribute(AIOKAFKA_CONSUMER, "_fetch_max_wait_ms", "app/consumer.py sets it before the fetcher starts"),
    Attribute(AIOKAFKA_CONSUMER, "_fetcher", "app/consumer.py installs the fetch guard on it (app/fetch_guard.py)"),
    Attribute(
        "aiokafka.consumer.fetcher.Fetcher",
        "_records",
        "app/fetch_guard.py replaces it with a dict that "
        "guards each stored FetchResult: a batch that cannot be decoded stops its own partition only",
    ),
    Attribute(
        "aiokafka.consumer.fetcher.FetchResult",
        "_partition_records",
        "app/fetch_guard.py wraps a fetched "
        "partition's records (tests/app/test_fetch_guard.py checks the behaviour on aiokafka's objects)",
    ),
    Attribute(
        "aiokafka.consumer.fetcher.PartitionRecords",
        "next_fetch_offset",
        "app/fetch_guard.py: where a partition stops at a batch it cannot decode, and where its position stays",
    ),
    Attribute(
        AIOKAFKA_CONSUMER, "_isolation_level", "app/consumer.py sets it before the fetcher starts (read_committed)"
    ),
    Attribute(AIOKAFKA_CONSUMER, "_fetcher", "app/consumer.py guards the fetcher (app/fetch_guard.py)"),
    Attribute("aiokafka.consumer.fetcher.Fetcher", "_records", "app/fetch_guard.py wraps the fetched results"),
    Attribute(
        "aiokafka.consumer.fetcher.FetchResult",
        "_partition_records",
        "app/fetch_guard.py wraps each partition's records",
    ),
    Attribute(
        "aiokafka.consumer.fetcher.PartitionRecords",
        "next_fetch_offset",
        "app/fetch_guard.py reads where a failed batch starts",
    ),
    Attribute(
        "aiokafka.consumer.fetcher.PartitionRecords",
        "_records",
        "app/fetch_guard.py wraps the record set (MemoryRecords) to know the batch a decode error came from",
    ),
    Attribute(AIOKAFKA_CONSUMER, "_subscription", "app/consumer.py reads positions from the subscription state"),
    Attribute(
        AIOKAFKA_CONSUMER,
        "_coordinator",
        "app/consumer.py surfaces coordinator errors, reads the member id and whether the group evicted it",
    ),
    Attribute(AIOKAFKA_CONSUMER, "_client", "agents/readers.py forces a metadata update"),
    Attribute(COORDINATOR, "_coordination_task", "app/consumer.py tells a dead coordinator from a parked error"),
    Attribute(
        COORDINATOR,
        "member_id",
        "app/consumer.py's member_id() feeds the tables' writer epochs; its evicted (blank after reset_generation, "
        "i.e. UnknownMemberId/IllegalGeneration, once a first assignment came: blank before the first JoinGroup too) "
        "stops agents/dispatcher.py's revoke from draining; _finished_holder, on_partitions_assigned and "
        "assignment_handed_over keep finished offsets, and take late acks, only for the same member id",
    ),
    Attribute(
        SERVICE,
        "_stopped",
        "app/consumer.py's fetch loop stops with the consumer and the fetcher; app/producer.py's flush stops waiting "
        "for its mark when the producer buffer stops",
    ),
    Attribute(
        SERVICE, "_crashed", "app/producer.py's flush stops waiting for its mark when the producer buffer crashes"
    ),
    Attribute(
        "faust.transport.drivers.aiokafka.Producer",
        "_producer",
        "app/producer.py's flush flushes the aiokafka producer under Faust's, as Faust's Producer.flush does",
    ),
    Attribute(
        "faust.transport.producer.ProducerBuffer",
        "pending",
        "the producer buffer's queue (asyncio.Queue) of FutureMessages: app/producer.py's flush takes its mark back "
        "out of it when it stops waiting",
    ),
    Attribute(
        "asyncio.Queue",
        "_queue",
        "the deque of a queue's items (ProducerBuffer.size reads it too): app/producer.py's flush removes its mark",
    ),
    Attribute(
        "faust.app.base.App",
        "_consumer",
        "agents/metrics.py and agents/control.py read the consumer without making one",
    ),
    Attribute(TABLE, "_store", "tables/rocksdb_tuning.py reads the table's own store URL"),
    Attribute(TABLE, "_data", "tables/rocksdb_tuning.py tunes a store that already exists"),
    Attribute(ROCKSDB_STORE, "_dbs", "tables/retry_state.py and tables/rocksdb_tuning.py read per-partition databases"),
    Attribute(ROCKSDB_STORE, "_key_index", "tables/fencing.py writes a marker into a partition's database"),
    Attribute(ROCKSDB_STORE, "offset_key", "tables/retry_state.py skips Faust's offset record in scans"),
    Attribute(ROCKSDB_STORE, "rocksdb_options", "tables/rocksdb_tuning.py replaces the options"),
    Attribute(RECOVERY, "_generation_id", "tables/fencing.py claims only for the recovery's own generation"),
    Attribute(RECOVERY, "signal_recovery_start", "tables/fencing.py gives a claim up when a rebalance starts"),
    Attribute(RECOVERY, "active_highwaters", "tables/fencing.py saves where a recovery read to"),
    Attribute(RECOVERY, "buffers", "tables/fencing.py takes back a record fetched before a rebalance"),
    Attribute(RECOVERY, "active_tps", "tables/fencing.py sets back the offset a replay took (active or standby)"),
    Attribute(RECOVERY, "active_offsets", "tables/fencing.py sets back the offset a replay took (active or standby)"),
    Attribute(RECOVERY, "standby_offsets", "tables/fencing.py sets back the offset a replay took (active or standby)"),
    Attribute(
        "faust.types.tuples.Message",
        "generation_id",
        "tables/fencing.py tells a record fetched before the group's last rebalance; app/consumer.py's abandon "
        "remembers finished offsets only of the generation being revoked",
    ),
    Attribute(
        WORKER,
        "_signal_stop_time",
        "app/shutdown.py's _schedule_shutdown reads it to tell the first stop signal (mode sets it then, and "
        "schedules the stop only once) from a repeated one: the watchdog is armed and logged once",
    ),
    Attribute(
        FLOW_CONTROL,
        "_queues",
        "app/consumer.py's CountingFlowControl.queued walks the queues it manages (the stream queues) to tell a "
        "hand-over whose copy landed after a clear from one whose put was cancelled",
    ),
    Attribute(
        "mode.utils.queues.ThrowableQueue",
        "_queue",
        "asyncio.Queue's deque of items, read (never changed) by CountingFlowControl.queued to find a landed copy",
    ),
    Attribute(
        "mode.utils.queues.FlowControlQueue",
        "_flow_control",
        "the flow control a stream queue obeys and is cleared by: it must be the app's (ReboundApp.flow_control, "
        "counting), checked by a behaviour test",
    ),
)

MODULE_NAMES: tuple[ModuleName, ...] = (
    ModuleName("faust.transport.consumer", "CONSUMER_FETCHING", "app/consumer.py's fetch loop sets Faust's diag flag"),
    ModuleName("faust.transport.consumer", "ensure_TPset", "app/consumer.py turns aiokafka's partitions into Faust's"),
    ModuleName(
        "faust.streams",
        "_current_event",
        "agents/dispatcher.py sets the current event in each work's task; agents/tier.py per record of a lane's group",
    ),
    ModuleName("faust.streams", "_CStreamIterator", "which stream iterator runs (see the cython behaviour)"),
    ModuleName(
        "faust.exceptions", "ConsumerNotStarted", "app/consumer.py and agents/livelock.py: nothing assigned yet"
    ),
    ModuleName("mode.utils.futures", "notify", "app/consumer.py wakes wait_empty"),
    ModuleName("faust.transport.drivers.aiokafka", "Transport", "app/consumer.py's ReboundTransport"),
    ModuleName("faust.transport.drivers.aiokafka", "Producer", "app/producer.py's ReboundProducer"),
)

BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(
        "throwable_queue_clear_cancels_putters",
        "mode's ThrowableQueue.clear() cancels the coroutines waiting "
        "to put: a hand-over to a full stream queue ends when the queue is cleared (app/consumer.py _deliver)",
    ),
    Behaviour(
        "conductor_put_swallows_cancellation",
        "Faust's conductor waits for a put to a full queue with "
        "asyncio.wait, which swallows the putter's cancellation: app/consumer.py marks such a hand-over void",
    ),
    Behaviour(
        "flow_control_resume_clears_stream_queues",
        "resuming Faust's flow control clears every stream queue: "
        "app/consumer.py's resume_flow reads those records again",
    ),
    Behaviour(
        "recovery_resumes_flow_control_before_consumer_flow",
        "Faust's recovery resumes stream partitions, "
        "seeks, then calls flow_control.resume() before consumer.resume_flow(): app/consumer.py's resume_flow "
        "and perform_seek depend on that order",
    ),
    Behaviour(
        "recovery_gathers_table_completions_with_asyncio_wait",
        "a table's on_recovery_completed that raises "
        "does not stop the recovery: tables/fencing.py crashes the app itself",
    ),
    Behaviour(
        "recovery_highwaters_are_last_offsets",
        "Faust's recovery keeps, per changelog partition, the end offset its consumer answers minus one (the last "
        "offset, -1 for an empty log) in active_highwaters: tables/fencing.py defers the records past it and reads "
        "from the next offset up to a claim's marker; an end offset kept instead would leave a record unread",
    ),
    Behaviour(
        "app_revocation_stops_the_flow_only_with_an_assignment",
        "Faust's App._on_partitions_revoked stops the consumer's flow (and waits for the streams) only when "
        "consumer.assignment() is non-empty: app/consumer.py's ReboundApp does those steps itself otherwise; a Faust "
        "that always does them would have them done twice",
    ),
    Behaviour(
        "a_resubscription_s_revocation_reads_no_assignment",
        "aiokafka's subscribe replaces the Subscription (the new one has no assignment, the old one is unassigned), and "
        "GroupCoordinator._on_join_prepare then revokes the previous assignment's partitions: the revocation after a "
        "resubscription reads consumer.assignment() empty (why ReboundApp._on_partitions_revoked exists)",
    ),
    Behaviour(
        "revocation_forgets_acknowledgements_before_the_app_callback",
        "Faust's on_partitions_revoked pops "
        "_acked, _acked_index, _gap, _committed_offset, then calls _on_partitions_revoked: app/consumer.py puts "
        "them back in between",
    ),
    Behaviour(
        "consumer_ack_bookkeeping",
        "Faust's Consumer.ack fills _acked, _acked_index, _n_acked and refuses "
        "offsets below the committed one: app/consumer.py's _new_offset reads exactly that",
    ),
    Behaviour(
        "faust_new_offset_commits_over_a_missing_head",
        "faust-streaming issue 606, the reason app/consumer.py "
        "overrides _new_offset; when this fails, Faust fixed it (PR 707): the override may be simplified",
    ),
    Behaviour("notify_tolerates_none", "app/consumer.py notifies _waiting_for_ack, None when nobody waits"),
    Behaviour(
        "fetch_max_wait_read_when_the_fetcher_starts",
        "app/consumer.py sets _fetch_max_wait_ms after the aiokafka consumer is made and before it starts",
    ),
    Behaviour(
        "commit_records_the_floor_even_when_it_fails",
        "Faust's _commit_offsets sets _committed_offset whether "
        "or not the commit succeeded (suspicion (a) of issue 22; tests/contract/test_suspicions.py)",
    ),
    Behaviour(
        "method_queue_runs_two_calls_at_once",
        "mode's MethodQueue has two workers: a consumer-thread call can "
        "overtake an earlier one that awaits (suspicion (b); tests/contract/test_suspicions.py)",
    ),
    Behaviour(
        "partition_records_take_batches_from_the_record_set_lazily",
        "PartitionRecords reads _records on its first step "
        "and only through has_next()/next_batch(), and a batch failing to decode is the last one handed out: "
        "app/fetch_guard.py's LastBatchRecords tells the operator where the failing batch ends from that",
    ),
    Behaviour(
        "flow_control_resume_goes_through_clear",
        "mode's FlowControlEvent.resume() empties the queues through self.clear(): app/consumer.py's "
        "CountingFlowControl counts clears there, and a hand-over that saw no count move is taken as delivered",
    ),
    Behaviour(
        "stream_queues_obey_the_app_s_flow_control",
        "app.FlowControlQueue() (every channel's queue) is managed by app.flow_control, which ReboundApp replaces "
        "with CountingFlowControl: otherwise the clears that cancel hand-overs would go uncounted",
    ),
    Behaviour(
        "topic_maxsize_sizes_its_streams_queue",
        "agents/topics.py raw_topic sets Topic.maxsize (App.topic drops its maxsize argument) so the main and release "
        "agents' stream queues hold at most REBOUND_PARTITION_BUFFER records: the queue in the back-pressure bound "
        "(docs/back-pressure.md)",
    ),
    Behaviour(
        "every_publish_asks_the_app_for_its_producer",
        "Topic.publish_message (every send, and every record the producer buffer sends: all tables' changelog "
        "records) gets its producer from app.maybe_start_producer(), through Topic._get_producer: app/consumer.py's "
        "ReboundApp overrides maybe_start_producer to skip mode's stampede once the producer is started",
    ),
    Behaviour(
        "faust_maybe_start_producer_is_a_stampede_around_producer_maybe_start",
        "Faust's App.maybe_start_producer is mode's stampede (its __wrapped__ the coroutine function "
        "ReboundApp._start_producer runs: app.producer after its maybe_start(), consumer.transactions in a "
        "transaction), caches its wrapper in the app's __dict__ under its name (why ReboundApp does not call "
        "super()'s) and gives the event loop away three times per call (why it is skipped; if that is gone, the "
        "override may go)",
    ),
    Behaviour(
        "a_started_service_s_maybe_start_returns_at_once",
        "mode's Service.start() marks the service started before on_start runs, and maybe_start() of a started "
        "service returns without waiting: so ReboundApp.maybe_start_producer returns a started producer at once as "
        "Faust's path does, and waits with a start it made itself (a producer still connecting is not ready)",
    ),
    Behaviour(
        "faust_commit_flushes_the_producer_then_commits",
        "Faust's Consumer._commit_offsets, outside a transaction, awaits app.producer.flush() before it commits "
        "(self._commit): what makes a commit wait for the changelog records written before it, through "
        "app/producer.py's bounded flush; a commit that no longer flushes there would need its own flush",
    ),
    Behaviour(
        "the_app_s_producer_comes_from_its_transport",
        "Faust's App._new_producer makes app.producer with its transport's create_producer, whose class is the "
        "transport's Producer: app/consumer.py's ReboundTransport sets it to app/producer.py's ReboundProducer, "
        "the one flush Faust's commit, revocation and stop go through",
    ),
    Behaviour(
        "faust_app_stop_flushes_the_producer_after_the_streams",
        "Faust's App.on_stop awaits _stop_consumer (fetcher stopped, streams waited for, tables stopped) before "
        "_producer_flush, which awaits self._producer.flush(): app/producer.py's bounded flush is right there because "
        "no stream writes after it, and it runs before the app's services (the producer among them) stop",
    ),
    Behaviour(
        "producer_buffer_flush_waits_for_an_empty_buffer",
        "ProducerBuffer.flush is flush_atmost(None), which goes on while the buffer holds records (giving up only "
        "after 0.1 s without a hand-over): under a steady flow of table writes the commit waited 10 to 30 s, why "
        "app/producer.py bounds it; when this fails, Faust changed its flush and the override may not be needed",
    ),
    Behaviour(
        "producer_buffer_hands_over_one_at_a_time_in_order",
        "the producer buffer's one task takes its FutureMessages in the order they were put and awaits each one's "
        "channel.publish_message(fut, wait=False) before the next: app/producer.py's flush puts a mark "
        "whose turn means that every record before it reached aiokafka's producer",
    ),
    Behaviour(
        "router_routes_a_table_key_by_its_bytes",
        "app/views.py route_by_key asks app.router.route_req(table name, key bytes, web, request): the key goes "
        "through the changelog topic's prepare_key unchanged (raw bytes) to the producer's key_partition (aiokafka's "
        "default partitioner, murmur2 as Kafka's Java producer), the owner's URL comes from the assignor's "
        "changelog_distribution, the request is forwarded there with its path and query (key_encoding), and "
        "SameNode is raised when this worker owns it: a key named in base64 reaches the worker owning its bytes",
    ),
    Behaviour(
        "router_forwards_to_the_active_owner_of_a_table_partition",
        "app/views.py route_to_partition takes app.router.table_metadata(table name) as each worker's URL with the "
        "changelog partitions it actively owns (the assignor's changelog_distribution, no standbys) and hands the URL "
        "of partition N's owner to Router._route_req(dest_url, web, request), which forwards the request there with "
        "its method, path, query (key_encoding, partition) and headers (the admin token) and answers with the owner's "
        "status and body, or raises SameNode for this worker's own URL: ?partition=N reaches N's owner",
    ),
    Behaviour(
        "livelock_detector_times_a_stream_from_stream_inbound_time",
        "AIOKafkaConsumerThread.verify_event_path reports a partition with records not fetched yet (highwater above "
        "the position) at ERROR, 'Stream stopped processing, or is slow', only once app.monitor.stream_inbound_time[tp] "
        "is stream_processing_timeout old: agents/livelock.py sets it to now when a pause or the breaker's hold ends, "
        "so that the time held is not reported as a stream standing still",
    ),
    Behaviour(
        "cython_stream_iterator_acks_inline",
        "the Cython stream iterator acks without Consumer.ack, so "
        "ReboundConsumer.ack does not see it (suspicion (c); tests/contract/test_suspicions.py)",
    ),
)

REBOUND_OVERRIDES: dict[str, frozenset[str]] = {
    "app.consumer.ReboundConsumer": frozenset(
        {
            "_new_consumer_thread",
            "resume_partitions",
            "verify_event_path",
            "on_buffer_drop",
            "stop_flow",
            "ack",
            "_seek",
            "perform_seek",
            "resume_flow",
            "seek",
            "on_partitions_revoked",
            "on_partitions_assigned",
            "_commit_offsets",
            "_filter_committable_offsets",
            "_new_offset",
            "_drain_messages",
        }
    ),
    "app.consumer.ReboundConsumerThread": frozenset(
        {"_create_worker_consumer", "_fetch_records", "on_start", "on_partitions_assigned"}
    ),
    "app.consumer.ReboundApp": frozenset(
        {"_new_transport", "flow_control", "on_start", "on_started", "maybe_start_producer", "_on_partitions_revoked"}
    ),
    "app.consumer.CountingFlowControl": frozenset({"clear"}),
    "app.consumer.ReboundTransport": frozenset({"Consumer", "Producer"}),
    "app.producer.ReboundProducer": frozenset({"flush"}),
    "app.shutdown.ReboundWorker": frozenset(
        {"_schedule_shutdown", "install_signal_handlers", "on_worker_shutdown", "stop_and_shutdown"}
    ),
}
"""The methods each of Rebound's subclasses overrides. Any other name they define must not exist in Faust's class: a
release adding it would have Rebound's replace it unseen."""


def all_names() -> frozenset[str]:
    return frozenset(
        [entry.name for entry in METHODS]
        + [entry.name for entry in ATTRIBUTES]
        + [entry.name for entry in MODULE_NAMES]
    )
