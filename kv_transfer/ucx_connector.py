"""The KV connector over UCX (``ucxx``): how blocks move from a prefill replica's cache to a
decode replica's.

This module is the connector's map; the producer (``ucx_producer``) and the consumer
(``ucx_consumer``) live in their own modules and are re-exported here. Lease bookkeeping
is ``leases``', the UCX thread and loop ``ucx_runtime``'s, block allocation the engine's.

Connections
    A producer listens on a plain TCP socket bound to exactly the address it advertises
    (its KV host, checked by ``local_addresses.check_bind_address``; never a wildcard). A
    consumer keeps one connection per producer address and reuses it; its pulls to one
    producer are serialised (pulls to different producers run concurrently). On it:

        consumer -> producer   Hello      engine id it expects, connection number,
                                          its UCX worker address(es), transport wanted,
                                          whether it can read the producer's cache
        producer -> consumer   Welcome    its engine id, transport chosen, its address;
                                          on shm to a reader: its cache's remote key
        (both open a UCX endpoint to the other's worker address)
        per pull the consumer reads (shm, host memory, a direct plan):
        consumer -> producer   BlockRequest   as below, marked "read"
        producer -> consumer   TransferStatus admission: "ok" (read now) or why not
        consumer =>            GETs           one RMA read per plan item (``ucx_rma``)
        consumer -> producer   ReadDone       its reads are over
        producer -> consumer   TransferStatus final: "ok" if the lease held throughout
        per pull sent by the producer (otherwise):
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
        shm, host memory: read by the consumer (mode "read"): an RMA GET per run, which
             UCX performs as cma's process_vm_readv: 1 copy per byte, cache to cache, and
             no work per run for the producer (it maps its cache once, at start).
        shm with ``remote_read=False``, or GPU caches: one tagged message per run from
             the producer, received in place: 1 copy per byte on shm (cma).
        tcp: tagged messages; no copy outside UCX; UCX's TCP rendezvous copies through
             its bounce buffers and the kernel's socket buffers on each side.
    staged (scattered blocks): gather into a staging buffer, send it in layer chunks,
    scatter each chunk as it lands (gather i+1 and scatter i overlap the wire).
        shm: 3 copies per byte (gather, cma, scatter).
        tcp: 2 copies outside UCX (gather, scatter) plus UCX's and the kernel's.
    Only a producer's host cache is registered (``ucp_mem_map``, for reads); sends and
    receives need no registration on cma and tcp (staging buffers are kept and reused
    per connection all the same). On GPU caches the same code hands UCX CUDA memory
    (``wire.as_wire``), for cuda_ipc or RDMA, and pulls are sent, never read.

Failure detection
    A producer killed mid-transfer closes its control connection (the kernel does, at
    once), which the consumer is reading for the final status: the pull fails as
    "unreachable" within milliseconds, and the connection goes (its UCX endpoint is
    force-closed, which withdraws the pull's receives and stops UCX writing into the
    local blocks before the failure is reported; the engine then frees them and
    recomputes). Backstops: UCX's own error handling (every endpoint asks for peer-failure
    handling: tcp sees the socket close, shared memory is checked by process id every
    ``KEEPALIVE_INTERVAL``), TCP keepalive on the control connection (a vanished host), and
    the pull's timeout (a frozen producer). A read pull does not watch the control
    connection while its GETs run: a dead producer fails them at once (its memory is
    gone: process_vm_readv fails), and the next control frame finds the connection closed. A consumer that goes away is noticed the same
    way by the producer, which force-closes its endpoint (cancelling its sends).

Leases while serving
    Admission checks the fingerprint, that the request holds a live lease and that the
    asked blocks are among the pinned ones. A staged gather holds the lease for one
    chunk's memcpy at a time (``LeaseTable.reading``), so the engine can end a lease
    mid-transfer and waits at most one chunk's copy, never the network. A direct transfer
    reads the cache over the network, so it does not hold the lease; the producer checks
    afterwards (after the last send completed, or after the consumer's ReadDone) that the
    lease it admitted stayed in force (``LeaseTable.holds``) and otherwise answers
    "lease_expired" (the consumer then discards what it received). A reader reads only
    after the admission "ok". Because the consumer
    keeps bytes only after the final "ok", which the producer sends only once every send
    completed (the consumer's reads finished), no buffer is reused under a reader, which
    is what makes ``CMA_MEMORY_INVALIDATE`` (``ucx_runtime``) safe here.

Security
    KV bytes over UCX are not encrypted or authenticated: a deployment keeps them on a
    private network. A producer's remote key lets a same-host consumer read its whole
    cache, not only leased blocks; it is handed out only over shared memory, where cma
    already needs the permission to read the producer's memory (ptrace access). The control plane (mTLS gRPC) decides which producer a decode replica
    pulls from; the engine-id check above makes sure the KV listener that answers is that
    producer's, as far as an unauthenticated peer can be trusted.
"""

from __future__ import annotations

from kv_transfer.transfer_plan import DEFAULT_CHUNK_BYTES, DIRECT_MIN_MESSAGE_BYTES
from kv_transfer.ucx_consumer import UcxKvConsumer
from kv_transfer.ucx_producer import UcxKvProducer

__all__ = ["DEFAULT_CHUNK_BYTES", "DIRECT_MIN_MESSAGE_BYTES", "UcxKvConsumer", "UcxKvProducer"]
