"""Process entry of a local stage worker: ``python -m tasklet.peer.emulation.worker_main --host 127.0.0.2``.

Prints ``READY <host:port> <certificate>`` on stdout once serving (the certificate of its ephemeral identity, in
peer.net.tls's one-line form; the launcher passes it on to the coordinator and into assignments), then runs
until the coordinator sends ``stop``, a
SIGTERM/SIGINT arrives, or the parent process dies — so a crashed test or launcher never leaves workers
behind. It lives in the emulation package because ``--fault`` starts a deliberately broken worker
(``peer.emulation.faults``); a real peer runs its worker inside ``peer start`` / ``peer join``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from tasklet.peer.emulation.faults import FAULTS, worker_class
from tasklet.peer.emulation.network import LinkModel, LoopbackLinks
from tasklet.peer.identity.certs import peer_id_of_certificate, pem_from_text
from tasklet.peer.net.tls import TlsContext


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port; 0 lets the OS pick (default: %(default)s)")
    parser.add_argument("--peer-id", default="", help="name used in logs and message headers")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; local swarms share cores (default: %(default)s)")
    parser.add_argument("--fault", choices=sorted(FAULTS), default=None,
                        help="testing aid: behave like a broken peer (nan-grad: send NaN gradients)")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: %(default)s)")
    parser.add_argument("--coordinator-cert", default="",
                        help="certificate (one-line form) of the coordinator that may assign this worker")
    parser.add_argument("--links", default="", help="the emulated network (peer.emulation.network.LinkModel, JSON)")
    parser.add_argument("--device", type=int, default=0, help="this worker's device in --links (default: 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {args.peer_id or 'worker'} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    parent = os.getppid()
    tls = TlsContext.generate()
    controllers: tuple[str, ...] = ()
    if args.coordinator_cert:
        coordinator = pem_from_text(args.coordinator_cert)
        tls.trust_only([coordinator])
        controllers = (peer_id_of_certificate(coordinator),)
    model = LinkModel.load(Path(args.links)) if args.links else None
    tflops = None if model is None else model.device_tflops(args.device)
    links = None if model is None or model.bandwidth_bps is None else LoopbackLinks(model, args.device)
    worker = worker_class(args.fault, tflops)(args.host, args.port, peer_id=args.peer_id, tls=tls,
                                              controllers=controllers, links=links)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stopped.set())
    endpoint = worker.start()
    print(f"READY {endpoint} {tls.certificate_text}", flush=True)
    try:
        while not worker.stopped.wait(0.5):
            if os.getppid() != parent:
                logging.getLogger(__name__).warning("parent process is gone; exiting")
                break
    finally:
        worker.stop()
    # Nothing is left to flush but the logs: skip the interpreter's teardown of torch and gRPC (about 1.7 s of a
    # 4-worker swarm's close on 2 cores, paid by every local swarm and every test that starts one).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
