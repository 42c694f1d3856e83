"""What a failed KV transfer raises. Every failure names the request and the peer, so a log line
says which pair of workers to look at."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer failed: the peer died, the channel broke, or the two sides disagreed.

    The channel it ran on is broken afterwards and is rebuilt on its next use.
    """


class KVTransferTimeout(KVTransferError):
    """A wait passed its deadline: the peer is stalled, gone, or the deadline is too short."""


class KVTransferCancelled(KVTransferError):
    """The sending side cancelled the transfer; the data that arrived must not be used."""
