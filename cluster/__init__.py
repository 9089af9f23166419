"""Expert-parallel groups as Ray gangs: placement, rendezvous, the rank class, health.

An EP group is `ep_size` ranks that Ray places and restarts as one. Under Serve it is a
gang-scheduled deployment (`cluster.serve_rank`); offline it is `ep_size` actors in one placement
group (`cluster.offline`). Both wrap the same `cluster.rank.EPRank`, which forms the
`torch.distributed` groups (`cluster.rendezvous`) and runs the engine.

Submodules are imported lazily by their users: importing `cluster` pulls in neither Ray Serve nor
the engine.
"""
