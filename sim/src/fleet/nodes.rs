//! The fleet's nodes as a simulation sees them: each node's free GPUs and, per model,
//! what it holds (staged on NVMe, hot in page cache, standbys parked in host memory),
//! each with the time it is ready; where a start goes and which tier it finds there.

use crate::fleet_config::{Fleet, Tier};

/// What one node holds of one model. Times are when each holding is (or was) ready.
#[derive(Clone, Debug, Default)]
pub(crate) struct Holding {
    pub(crate) staged: Option<f64>,
    pub(crate) hot: Option<f64>,
    /// Standbys parked in host memory, by ready time.
    pub(crate) host: Vec<f64>,
    /// Its last start here, for least-recently-used eviction.
    pub(crate) last_used: f64,
}

#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub(crate) free_gpus: u32,
    pub(crate) hold: Vec<Holding>,
    pub(crate) nvme_used: f64,
    pub(crate) ram_used: f64,
}

/// What a policy's starts leave behind on their node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keeps {
    /// The snapshot a start fetched stays staged on NVMe (least recently used out).
    pub(crate) staged: bool,
    /// The snapshot a start read stays in page cache (least recently used out).
    pub(crate) hot: bool,
    /// Kernel and graph caches are restored at each start.
    pub(crate) engine_caches: bool,
}

pub(crate) struct Cluster<'f> {
    pub(crate) fleet: &'f Fleet,
    pub(crate) nodes: Vec<Node>,
    /// GPUs held by replicas (serving, starting, draining), fleet-wide.
    pub(crate) gpus_held: u32,
    pub(crate) keeps: Keeps,
    /// Starts per model by tier ([`Tier::ALL`]'s order).
    pub(crate) starts: Vec<[u32; 5]>,
    /// Start times per model, for the planner's rate of starts.
    pub(crate) start_times: Vec<Vec<f64>>,
    /// Decisions that wanted a start and found no GPU within the fleet's budget (each
    /// retried at the next decision, which counts again).
    pub(crate) deferred: u32,
    /// Replicas up per model (starting or serving), fleet-wide.
    pub(crate) replicas: Vec<u32>,
}

fn tier_index(t: Tier) -> usize {
    Tier::ALL.iter().position(|&x| x == t).unwrap_or(4)
}

impl<'f> Cluster<'f> {
    pub(crate) fn new(fleet: &'f Fleet, keeps: Keeps) -> Self {
        let m = fleet.models.len();
        Cluster {
            fleet,
            nodes: (0..fleet.nodes)
                .map(|_| Node {
                    free_gpus: fleet.gpus_per_node,
                    hold: vec![Holding::default(); m],
                    nvme_used: 0.0,
                    ram_used: 0.0,
                })
                .collect(),
            gpus_held: 0,
            keeps,
            starts: vec![[0; 5]; m],
            start_times: vec![Vec::new(); m],
            deferred: 0,
            replicas: vec![0; m],
        }
    }

    fn bytes(&self, m: usize) -> f64 {
        self.fleet.models[m].weight_bytes()
    }

    /// The warmest tier model `m` finds on node `n` at `t`.
    pub(crate) fn tier(&self, n: usize, m: usize, t: f64) -> Tier {
        let h = &self.nodes[n].hold[m];
        let ready = |at: Option<f64>| at.is_some_and(|a| a <= t);
        if h.host.iter().any(|&a| a <= t) {
            Tier::HostStandby
        } else if ready(h.hot) {
            Tier::Hot
        } else if ready(h.staged) {
            Tier::Staged
        } else {
            Tier::Remote
        }
    }

    /// The warmest tier model `m` holds anywhere at `t`, as a level (0 remote … 3
    /// host standby), for the tier timeline.
    pub(crate) fn best_level(&self, m: usize, t: f64) -> u8 {
        (0..self.nodes.len())
            .map(|n| 4 - tier_index(self.tier(n, m, t)) as u8)
            .max()
            .unwrap_or(0)
    }

    /// The node a replica of `m` goes to at `t`: the warmest with a free GPU, the
    /// freest among equals; `None` when none has room within the fleet's GPU budget.
    fn place(&self, m: usize, t: f64) -> Option<usize> {
        let g = self.fleet.models[m].gpus_per_replica;
        if self.gpus_held + g > self.fleet.max_gpus {
            return None;
        }
        (0..self.nodes.len())
            .filter(|&n| self.nodes[n].free_gpus >= g)
            .min_by_key(|&n| {
                (
                    self.tier(n, m, t),
                    std::cmp::Reverse(self.nodes[n].free_gpus),
                )
            })
    }

    /// A replica of model `m` is wanted at `t`: the node it goes to ([`Cluster::place`])
    /// and its start-up time from the tier it finds there.
    pub(crate) fn start(&mut self, m: usize, t: f64) -> Option<(u16, f64)> {
        let Some(n) = self.place(m, t) else {
            self.deferred += 1;
            return None;
        };
        let g = self.fleet.models[m].gpus_per_replica;
        let tier = self.tier(n, m, t);
        let fleet = self.fleet;
        let model = &fleet.models[m];
        let bytes = self.bytes(m);
        let ready_in = fleet.start_s(model, tier, self.keeps.engine_caches);
        self.gpus_held += g;
        self.replicas[m] += 1;
        self.starts[m][tier_index(tier)] += 1;
        self.start_times[m].push(t);
        let node = &mut self.nodes[n];
        node.free_gpus -= g;
        node.hold[m].last_used = t;
        match tier {
            Tier::HostStandby => {
                // The ready standby with the earliest time is promoted.
                let host = &mut node.hold[m].host;
                if let Some(i) = host.iter().position(|&a| a <= t) {
                    host.swap_remove(i);
                    node.ram_used -= bytes;
                }
            }
            Tier::Remote => {
                let staged_at = t + fleet.steps(model).fetch_s;
                // What page cache holds is read from the staged file: without room
                // on NVMe, neither stays.
                if self.keeps.staged && self.keep_staged(n, m, staged_at) && self.keeps.hot {
                    self.keep_hot(n, m, t + ready_in);
                }
            }
            Tier::Staged => {
                if self.keeps.hot {
                    self.keep_hot(n, m, t + ready_in);
                }
            }
            Tier::Hot | Tier::GpuStandby => {}
        }
        Some((n as u16, ready_in))
    }

    /// A replica that was running before the trace began (a pool opened at the size
    /// its first minute needs): its GPUs, and its snapshot kept as its policy keeps
    /// them.
    pub(crate) fn initial(&mut self, m: usize) -> Option<u16> {
        let n = self.place(m, 0.0)?;
        let g = self.fleet.models[m].gpus_per_replica;
        self.gpus_held += g;
        self.replicas[m] += 1;
        self.nodes[n].free_gpus -= g;
        if self.keeps.staged && self.keep_staged(n, m, 0.0) && self.keeps.hot {
            self.keep_hot(n, m, 0.0);
        }
        Some(n as u16)
    }

    /// A replica of model `m` on node `n` left.
    pub(crate) fn stop(&mut self, m: usize, n: u16) {
        let g = self.fleet.models[m].gpus_per_replica;
        let per_node = self.fleet.gpus_per_node;
        let node = &mut self.nodes[usize::from(n)];
        debug_assert!(
            self.gpus_held >= g && self.replicas[m] > 0,
            "given back twice"
        );
        debug_assert!(node.free_gpus + g <= per_node, "given back twice");
        self.gpus_held -= g;
        self.replicas[m] -= 1;
        node.free_gpus += g;
    }

    /// Stages `m` on `n` (ready at `at`), the least recently used staged models out
    /// for room, unless `pinned` keeps them; false when it does not fit.
    pub(crate) fn stage(
        &mut self,
        n: usize,
        m: usize,
        at: f64,
        pinned: &dyn Fn(usize) -> bool,
    ) -> bool {
        if self.nodes[n].hold[m].staged.is_some() {
            return true;
        }
        let bytes = self.bytes(m);
        let cap = self.fleet.nvme_bytes;
        while self.nodes[n].nvme_used + bytes > cap + 1.0 {
            // Hot and parked copies are read from their staged file: they go with it.
            let Some(v) = self.least_recent(n, m, |h| h.staged.is_some(), pinned) else {
                return false;
            };
            self.unstage(n, v);
        }
        let node = &mut self.nodes[n];
        node.hold[m].staged = Some(at);
        node.nvme_used += bytes;
        true
    }

    /// The model other than `m` that `n` holds as `has` says, not `pinned`, started
    /// there least recently: the one to evict for `m`.
    fn least_recent(
        &self,
        n: usize,
        m: usize,
        has: impl Fn(&Holding) -> bool,
        pinned: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        let hold = &self.nodes[n].hold;
        (0..hold.len())
            .filter(|&v| v != m && has(&hold[v]) && !pinned(v))
            .min_by(|&a, &b| hold[a].last_used.total_cmp(&hold[b].last_used))
    }

    fn keep_staged(&mut self, n: usize, m: usize, at: f64) -> bool {
        self.stage(n, m, at, &|_| false)
    }

    /// Drops `m`'s staged file from `n` (with what was read from it).
    pub(crate) fn unstage(&mut self, n: usize, m: usize) {
        let bytes = self.bytes(m);
        self.drop_hot(n, m);
        self.drop_host(n, m, 0);
        let node = &mut self.nodes[n];
        if node.hold[m].staged.take().is_some() {
            node.nvme_used -= bytes;
        }
    }

    /// Makes `m` hot on `n` (ready at `at`), the least recently used hot snapshots out
    /// for room unless `pinned`; false when it does not fit.
    pub(crate) fn make_hot(
        &mut self,
        n: usize,
        m: usize,
        at: f64,
        pinned: &dyn Fn(usize) -> bool,
    ) -> bool {
        if self.nodes[n].hold[m].hot.is_some() {
            return true;
        }
        if !self.take_ram(n, m, pinned) {
            return false;
        }
        self.nodes[n].hold[m].hot = Some(at);
        true
    }

    /// Takes host RAM on `n` for a copy of `m`, making room unless `pinned` forbids.
    fn take_ram(&mut self, n: usize, m: usize, pinned: &dyn Fn(usize) -> bool) -> bool {
        let bytes = self.bytes(m);
        if !self.ram_room(n, m, bytes, pinned) {
            return false;
        }
        self.nodes[n].ram_used += bytes;
        true
    }

    fn keep_hot(&mut self, n: usize, m: usize, at: f64) {
        self.make_hot(n, m, at, &|_| false);
    }

    /// Frees host RAM on `n` for `bytes` by dropping the least recently used hot
    /// snapshots of other models that are not `pinned`.
    fn ram_room(&mut self, n: usize, m: usize, bytes: f64, pinned: &dyn Fn(usize) -> bool) -> bool {
        let cap = self.fleet.host_ram_bytes;
        while self.nodes[n].ram_used + bytes > cap + 1.0 {
            let Some(v) = self.least_recent(n, m, |h| h.hot.is_some(), pinned) else {
                return false;
            };
            self.drop_hot(n, v);
        }
        true
    }

    pub(crate) fn drop_hot(&mut self, n: usize, m: usize) {
        let bytes = self.bytes(m);
        let node = &mut self.nodes[n];
        if node.hold[m].hot.take().is_some() {
            node.ram_used -= bytes;
        }
    }

    /// Parks a standby of `m` in `n`'s host memory, ready at `at`; false when it does
    /// not fit beside what is `pinned`.
    pub(crate) fn park_host(
        &mut self,
        n: usize,
        m: usize,
        at: f64,
        pinned: &dyn Fn(usize) -> bool,
    ) -> bool {
        if !self.take_ram(n, m, pinned) {
            return false;
        }
        self.nodes[n].hold[m].host.push(at);
        true
    }

    /// Drops `m`'s host-parked standbys on `n` beyond `keep`, the last parked first.
    pub(crate) fn drop_host(&mut self, n: usize, m: usize, keep: usize) {
        let bytes = self.bytes(m);
        let node = &mut self.nodes[n];
        while node.hold[m].host.len() > keep {
            node.hold[m].host.pop();
            node.ram_used -= bytes;
        }
    }
}
