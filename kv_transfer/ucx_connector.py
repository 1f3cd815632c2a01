"""The KV connector over UCX (``ucxx``): how blocks move from a prefill replica's cache to a
decode replica's.

This module is the connector's map; the producer (``ucx_producer``) and the consumer
(``ucx_consumer``) live in their own modules and are re-exported here. Lease bookkeeping
is ``leases``', the UCX thread and loop ``ucx_runtime``'s, block allocation the engine's.

Connections
    A producer listens on a plain TCP socket bound to exactly the address it advertises
    (its KV host, checked by ``local_addresses.check_bind_address``; never a wildcard). A
    consumer keeps one connection per producer address and reuses it; its pulls to one
    producer are serialised (pulls to different producers run concurrently). On it (protocol
    version 4; ``wire`` says what version 3, still served, does differently):

        consumer -> producer   Hello      protocol version, engine id it expects,
                                          connection number, its UCX worker address(es),
                                          transport wanted, whether it can read
        producer -> consumer   Welcome    its engine id, transport chosen, its address, its
                                          layout's fingerprint; to a reader (shm or tcp): its
                                          cache's remote key, address and number of blocks
        (both open a UCX endpoint to the other's worker address; over TCP a reader and the
        producer exchange one message each way first, see ``UcxKvConsumer._until_wired``)
        per pull the consumer reads (host memory, a direct plan), metadata exchanged once:
        consumer =>            GETs           one RMA read per run of bytes contiguous in
                                              both caches (``ucx_rma.coalesce_reads``), no
                                              frame before them
        consumer -> producer   ReadConfirm    the lease read and its generation
        producer -> consumer   TransferStatus final: "ok" if that lease is still in force
        per pull sent by the producer (the fallback: a consumer that cannot read, GPU
        caches, or a staged plan):
        consumer -> producer   BlockRequest   request id, blocks, layout fingerprint,
                                              sequence number, transfer plan
        producer -> consumer   TransferStatus admission: "ok" or why not
        producer => consumer   payload        over UCX, one tagged message per plan item
        producer -> consumer   TransferStatus final: "ok" once every message was
                                              delivered while the lease held

    The control connection is ucxx-free on purpose: ucxx's listener binds every interface
    and cannot be told otherwise, and the connection's liveness is the fastest failure
    detector there is (below). The consumer checks that the engine that answers is the
    one its handle names, so a handle advertising a loopback address to another host fails
    as "unreachable" with that reason instead of reaching whatever listens there.

Transports
    Same host (the producer's address is one of the consumer's own addresses, judged in
    its network namespace: another namespace is another host; ``local_addresses``): the
    consumer offers its full UCX worker address and UCX builds shared-memory lanes, posix
    or sysv for small messages and cma for large ones (a zero-copy rendezvous: one
    ``process_vm_readv`` from the producer's memory into the consumer's). Other hosts:
    both sides hand each other network-only addresses (``ucp_introspection``), so UCX
    can only use TCP (or RDMA where it has it). The producer applies the same rule to the
    consumer's source address. What UCX really chose is read back from the endpoint
    (``ucp_introspection.endpoint_lanes``) and reported with every pull (``TransferResult.transport``:
    "shm", "tcp", "self" within one process), which the engine turns into the
    ``transport`` label of the ``tandem:kv_transfer_*`` metrics.

Copies per byte (a pull of n blocks; ``transfer_plan`` picks the mode per pull)
    direct (the blocks form runs consecutive in both caches; each message at least
    ``DIRECT_MIN_MESSAGE_BYTES`` on average): one (layer, K/V, run) at a time, from the
    producer's cache straight into the consumer's cache.
        host memory, read by the consumer (mode "read"): one RMA GET per run of blocks
             consecutive on both sides, per layer and K/V (the cache is ``[layers, 2,
             blocks, ...]``: two groups' rows are adjacent only when a pull covers every
             block, and ``ucp_get_nbx`` takes one contiguous stretch per call), no work per
             run for the producer (it maps its cache once, at start). On shm UCX performs
             a GET as cma's process_vm_readv: 1 copy per byte, cache to cache. Over TCP
             UCX emulates GETs with active messages, answered by the producer's UCX
             progress thread: no copy outside UCX.
        ``remote_read=False``, or GPU caches (the "sent" fallback): one tagged message per
             run from the producer, received in place: 1 copy per byte on shm (cma); over
             TCP UCX's rendezvous copies through its bounce and the kernel's buffers.
    staged (scattered blocks): gather into a staging buffer, send it in layer chunks,
    scatter each chunk as it lands (gather i+1 and scatter i overlap the wire).
        shm: 3 copies per byte (gather, cma, scatter).
        tcp: 2 copies outside UCX (gather, scatter) plus UCX's and the kernel's.
    Only a producer's host cache is registered (``ucp_mem_map``, for reads); sends and
    receives need no registration on cma and tcp (staging buffers are kept and reused
    per connection all the same). On GPU caches the same code hands UCX CUDA memory
    (``wire.as_wire``), for cuda_ipc or RDMA, and pulls are sent, never read (mapping
    CUDA memory for GETs, which UCX's cuda_ipc takes, is not written: no GPU was at hand).

Failure detection
    A producer killed mid-transfer closes its control connection (the kernel does, at
    once), which the consumer is reading for the final status: the pull fails as
    "unreachable" within milliseconds, and the connection goes (its UCX endpoint is
    force-closed, which withdraws the pull's receives and stops UCX writing into the
    local blocks before the failure is reported; the engine then frees them and
    recomputes). Backstops: UCX's own error handling (every endpoint asks for peer-failure
    handling: tcp sees the socket close, shared memory is checked by process id every
    ``KEEPALIVE_INTERVAL``), TCP keepalive on the control connection (a vanished host), and
    the pull's timeout (a frozen producer). A read pull's GETs are progressed on the loop's
    thread (up to ``INLINE_READ_BYTES``), or by ucxx's progress thread while the loop watches
    the control connection (the producer writes nothing until the confirmation): its closing aborts
    the endpoint, which ends the GETs in flight (over cma a dead producer's memory is gone
    and they fail by themselves). A consumer that goes away is noticed the same way by the
    producer, which force-closes its endpoint (cancelling its sends).

Leases while serving
    A sent pull is admitted first: the fingerprint, a live lease for the request, the asked
    blocks among the pinned ones. A staged gather holds the lease for one chunk's memcpy at
    a time (``LeaseTable.reading``), so the engine can end a lease mid-transfer and waits at
    most one chunk's copy, never the network. A direct send reads the cache over the
    network, so it does not hold the lease; the producer checks after the last send
    completed that the lease it admitted stayed in force (``LeaseTable.holds``) and
    otherwise answers "lease_expired" (the consumer then discards what it received).

    A read is admitted by nobody: the consumer reads as soon as it has a handle, and asks
    afterwards. Why no read can observe a reused block undetected: a block is rewritten only
    after the engine frees it, and the engine frees a pinned block only in ``on_release``,
    after its lease left the table (``KvProducer``). Every lease has a generation no earlier
    pin of the same id had (its deadline in ms, which the handle carries: ``leases``). The
    consumer sends ``ReadConfirm`` (lease id, generation, blocks) only once every GET has
    landed, and keeps the bytes only if the producer answers that the lease of that
    generation is in force *now*. The lease existed before the reads began (the handle
    came from its pin), and a lease that leaves the table never comes back (a new pin of
    the same id, a re-pinned announcement say, is another generation); so a lease in force
    at the confirmation was in force during every read, its blocks were never freed, and
    the bytes read are the bytes pinned. Any other answer ("lease_expired": ended,
    expired, or pinned again; "unknown_request") fails the pull, and the engine recomputes
    (the local blocks written meanwhile are its to discard). The consumer keeps bytes only
    after a final "ok" that follows its last read or the producer's last completed send,
    so no buffer is reused under a reader, which is what makes ``CMA_MEMORY_INVALIDATE``
    (``ucx_runtime``) safe here.

Security
    KV bytes over UCX are not encrypted or authenticated: a deployment keeps them on a
    private network. A producer's remote key lets a consumer read its whole cache, not only
    leased blocks (as NIXL's do): on shared memory cma needs the permission to read the
    producer's memory anyway (ptrace access); over TCP (version 4) any peer that completes
    the hello on the KV network can read the cache, the trust the unauthenticated KV
    network already implies for the bytes it carries. The control plane (mTLS gRPC) decides which producer a decode replica
    pulls from; the engine-id check above makes sure the KV listener that answers is that
    producer's, as far as an unauthenticated peer can be trusted.
"""

from __future__ import annotations

from kv_transfer.transfer_plan import DEFAULT_CHUNK_BYTES, DIRECT_MIN_MESSAGE_BYTES
from kv_transfer.ucx_consumer import UcxKvConsumer
from kv_transfer.ucx_producer import UcxKvProducer

__all__ = ["DEFAULT_CHUNK_BYTES", "DIRECT_MIN_MESSAGE_BYTES", "UcxKvConsumer", "UcxKvProducer"]
