"""KV migration between elastic instances (LoongServe §5.2: the allocation step frees `e_min` for a prefill).

The scheduler tells the destination (`MigrateKVIn`); the destination picks a data-plane tag and asks the source
(`MigrateKVOut`); the source sends, over the data plane, `[tokens, prompt tokens, entries, spec bytes]`, the
token ids, the entries' positions, the encoded request spec and the KV `[2, layers, entries, kv_heads, head_dim]`,
each with its header checked against what the previous one announced. The destination adopts the request as a
directed sequence it masters and reports `KVMigrated`; the source forgets it. Neither side runs the request
meanwhile (the scheduler sends no iteration with it, nor any to the source). A failure on either side fails
the request (503), which frees it everywhere.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch
from nats.aio.msg import Msg

from spindle_engine import Engine
from spindle_engine.esp import parts
from spindle_engine.esp.exchange import MAX_HANDOVER_BYTES
from spindle_protocol import header_for, subjects
from spindle_protocol.messages import KVMigrated, MigrateKVIn, MigrateKVOut, RequestSpec
from spindle_transfer.wire import dtype_name
from spindle_worker import Job, sampling_params

log = logging.getLogger("spindle.elastic.migrate")


class KVMigration:
    """Both sides of a migration (mixed into `ElasticInstance`, which provides the attributes)."""

    id: str
    jobs: dict[str, Job]

    async def on_migrate_in(self, cmd: MigrateKVIn, raw: Msg) -> None:
        rid, src, t0 = cmd.request_id, cmd.src_rank, time.time()
        tag = self.dp.new_tag()
        await self.bus.publish(
            subjects.elastic_migrate_out(cmd.src),
            MigrateKVOut(request_id=rid, dst=self.id, dst_rank=self.config.rank, tag=tag),
        )
        try:
            meta = await self.dp.recv_async(header_for("int64", [4]), src, tag)
            n_tokens, n_prompt, n, spec_len = (int(x) for x in meta.tolist())
            if not (0 < n_prompt < n_tokens <= self.engine.max_model_len + 1 and 0 < n < n_tokens):
                raise ValueError(f"a migration of {n} KV entries of {n_tokens} tokens ({n_prompt} prompt)")
            if not 0 < spec_len <= MAX_HANDOVER_BYTES:
                raise ValueError(f"a request spec of {spec_len} bytes")
            tokens = await self.dp.recv_async(header_for("int64", [n_tokens]), src, tag)
            positions = await self.dp.recv_async(header_for("int64", [n]), src, tag)
            spec_bytes = await self.dp.recv_async(header_for("uint8", [spec_len]), src, tag)
            k = self.engine.cache.k
            kv_header = header_for(dtype_name(k.dtype), [2, k.shape[0], n, k.shape[3], k.shape[4]])
            kv = await self.dp.recv_async(kv_header, src, tag, device=self.config.device)
            spec = msgspec.msgpack.decode(spec_bytes.numpy().tobytes(), type=RequestSpec)
            if spec.request_id != rid or not bool(((positions >= 0) & (positions < n_tokens - 1)).all()):
                raise ValueError(f"the migrated spec or positions do not belong to {rid}")
            params = sampling_params(spec.sampling)

            def adopt(engine: Engine) -> None:
                seq = parts.new_sequence(engine, rid, tokens.tolist(), n_prompt, params)
                try:
                    parts.import_kv(engine, seq, positions, kv)
                except Exception:
                    parts.drop(engine, rid)
                    raise

            await self.call(adopt)
        except Exception as e:
            log.warning("%s: taking %s from %s failed: %s", self.id, rid, cmd.src, e)
            await self.fail_request(rid, 503, f"KV migration {cmd.src} -> {self.id} failed: {e}")
            return
        if self.is_aborted(rid):  # its Abort came while the KV moved: nothing else frees it here
            await self.call(lambda e: e.abort(rid))
            return
        job = self.jobs.get(rid) or self.new_job(spec, raw)
        if job is not None:
            job.prefilled, job.next_seq = True, n_tokens - n_prompt  # the source sent those
        log.info("%s: took %s over from %s (%d KV entries, %.3f s)", self.id, rid, cmd.src, n, time.time() - t0)
        done = KVMigrated(request_id=rid, instance_id=cmd.src, dst=self.id, num_tokens=n, seconds=time.time() - t0)
        await self.bus.publish(subjects.EVENTS, done)

    async def on_migrate_out(self, cmd: MigrateKVOut, raw: Msg) -> None:
        rid, dst = cmd.request_id, cmd.dst_rank
        job = self.jobs.get(rid)

        def export(engine: Engine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            seq = engine.directed[rid]
            positions, kv = parts.export_kv(engine, seq)
            meta = torch.tensor([seq.num_tokens, seq.num_prompt_tokens, positions.numel()], dtype=torch.int64)
            return meta, torch.tensor(seq.token_ids, dtype=torch.int64), positions, kv

        try:
            if job is None:
                raise ValueError(f"{rid} is not on {self.id}")
            meta, tokens, positions, kv = await self.call(export)
            spec = torch.frombuffer(bytearray(msgspec.msgpack.encode(job.spec)), dtype=torch.uint8)
            meta = torch.cat([meta, torch.tensor([spec.numel()])])
            for t in (meta, tokens, positions, spec, kv):
                await self.dp.send_async(t, dst, cmd.tag, header_for(dtype_name(t.dtype), list(t.shape)))
        except Exception as e:
            log.warning("%s: handing %s to %s failed: %s", self.id, rid, cmd.dst, e)
            await self.fail_request(rid, 503, f"KV migration {self.id} -> {cmd.dst} failed: {e}")
            return
        await self.call(lambda e: parts.drop(e, rid, "moved"))
        self.forget(rid)
