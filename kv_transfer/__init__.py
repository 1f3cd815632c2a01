"""Moving paged KV blocks from a prefill replica's cache to a decode replica's over UCX.

``connector`` is the interface the engine codes against; ``ucx_connector`` implements
it on ``ucxx``. Importing this package does not load UCX; starting a connector does.
"""

from kv_transfer.connector import (
    TRANSFER_FAILURES,
    KvConsumer,
    KvHandle,
    KvProducer,
    KvTransferError,
    ReleaseCallback,
    TransferFailure,
    TransferResult,
)
from kv_transfer.layout import KvLayout, dtype_name
from kv_transfer.ucx_connector import UcxKvConsumer, UcxKvProducer

__all__ = [
    "TRANSFER_FAILURES",
    "KvConsumer",
    "KvHandle",
    "KvLayout",
    "KvProducer",
    "KvTransferError",
    "ReleaseCallback",
    "TransferFailure",
    "TransferResult",
    "UcxKvConsumer",
    "UcxKvProducer",
    "dtype_name",
]
