"""How KV travels from prefill ranks to decode ranks. Imports only engine's KV layout and pool.

Two layers, so the bookkeeping is testable in one process and the bytes in real ones:

Instance level (the worker's driver, pure Python over its BlockPool; returns messages that the
control plane carries, see messages.py):

    decode:  receiver = KVReceiver(pool, block_size, instance_id, endpoints, config)
             answer = receiver.reserve(KVReserveRequest(...))    # KVTicket | KVRefusal
             ... each rank ends -> receiver.on_rank_finished(rid, rank, error) -> KVTransferDone?
             receiver.claim(rid) once landed; receiver.abort / on_abort / expire
    prefill: sender = KVSender(pool, tp_size, on_released)
             sender.start(ticket, block_ids)                      # holds the source blocks
             ... each rank ends -> sender.on_rank_finished(rid, rank, error) -> KVAbort?
             sender.on_done(KVTransferDone)  -> on_released(rid, success), exactly once
             sender.abort / on_abort / expire

Rank level (every TP rank, over its KVCache; channels are made on demand per rank pair):

    decode rank:  KVRankReceiver(cache, ChannelHost(device), rank, num_kv_heads).receive(ticket)
                  -> RecvHandle: done(), wait() -> ReceivedKV (first token), finished_at
    prefill rank: KVRankSender(cache, ChannelDialer(device), rank, num_kv_heads)
                  handle = sender.start(ticket, block_ids); handle.send_layer(l) per layer;
                  handle.finish(first_token_id); handle.done() / wait(); handle.cancel();
                  sender.cancel_unstarted(ticket) when the prefill never ran.

Re-sharding between TP sizes: plan.py. The wire format and its two modes: wire.py. Each channel
carries one ordered stream of transfers, so nothing relies on tags (NCCL has none): streams.py.
Channels: channel.py, their rendezvous: rendezvous.py. Within a node the KV skips the socket:
same_node.py (shared memory on CPU, both sides copying a share; CUDA IPC on GPU).
"""
