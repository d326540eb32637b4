"""keyserial: every op on a key runs on one serial executor, so no distributed lock is needed.

``await ks.submit("account:5", withdraw(30))`` routes the op by ``crc32(key) % N`` to one of N
shards; each shard is a Redis stream that exactly one worker consumes at a time.
"""

from ._client.api import Client as Client
from ._client.connect import connect as connect
from ._client.metrics import register_client_metrics as register_client_metrics
from ._client.sync import SyncClient as SyncClient
from ._client.sync import connect_sync as connect_sync
from ._ops import Context as Context
from ._ops import MultiContext as MultiContext
from ._ops import Op as Op
from ._ops import Registry as Registry
from ._ops import call as call
from ._ops import multi_op as multi_op
from ._ops import op as op
from ._reshard.api import reshard as reshard
from ._reshard.mover import Resharded as Resharded
from ._settings import Settings as Settings
from ._wire.call import Call as Call
from ._wire.routing import shard_for as shard_for
from ._worker.worker import Worker as Worker
from .errors import BackendUnavailable as BackendUnavailable
from .errors import BacklogFull as BacklogFull
from .errors import ConfigError as ConfigError
from .errors import InsufficientFunds as InsufficientFunds
from .errors import KeyserialError as KeyserialError
from .errors import LeaseLost as LeaseLost
from .errors import MalformedOperation as MalformedOperation
from .errors import OperationFailed as OperationFailed
from .errors import OutcomeUnknown as OutcomeUnknown
from .errors import PayloadTooLarge as PayloadTooLarge
from .errors import PoisonOperation as PoisonOperation
from .errors import ReshardRefused as ReshardRefused
from .errors import ResultNotFound as ResultNotFound
from .errors import ShardCountMismatch as ShardCountMismatch
from .errors import SubmitTimeout as SubmitTimeout
from .errors import TimerCancelled as TimerCancelled
from .errors import UnknownOperation as UnknownOperation

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "BacklogFull",
    "Call",
    "Client",
    "ConfigError",
    "Context",
    "InsufficientFunds",
    "KeyserialError",
    "LeaseLost",
    "MalformedOperation",
    "MultiContext",
    "Op",
    "OperationFailed",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "PoisonOperation",
    "Registry",
    "ReshardRefused",
    "Resharded",
    "ResultNotFound",
    "Settings",
    "ShardCountMismatch",
    "SubmitTimeout",
    "SyncClient",
    "TimerCancelled",
    "UnknownOperation",
    "Worker",
    "call",
    "connect",
    "connect_sync",
    "multi_op",
    "op",
    "register_client_metrics",
    "reshard",
    "shard_for",
]
