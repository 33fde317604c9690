"""Past one machine, on Ray: the optional `ray` extra (`pip install 'personaplex-cli[ray]'`).

- `ray_cluster`: Ray itself: imported only here (a one-line error without the extra, exit 9),
             a cluster joined or started, what it holds.
- `replies`: `reply --manifest --ray`: the checked jobs as a Ray dataset, answered by a pool
             of workers (Ray Data actors), each holding one model and running the same
             continuous batching as one machine (batch.run) over the rows it is given.
- `serving`: `serve --ray`: one engine per GPU as a Ray Serve deployment, each running the
             same server as one machine; an ingress deployment admits every caller to a
             replica with a free slot and relays its WebSocket there.

Nothing outside this package imports Ray, so the default install stays as light as it is.
"""
