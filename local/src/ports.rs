//! Loopback ports for the processes `up` and the benchmarks start.

/// A loopback port free now (bound and released).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The first of `n` consecutive loopback ports all free now (held together while
/// checked): for standbys, which listen on `base + i` (and `+ 1` for KV).
pub(crate) fn free_port_run(n: u16) -> anyhow::Result<u16> {
    for _ in 0..64 {
        let base = free_port()?;
        let held: Result<Vec<_>, _> = (1..n)
            .map(|i| std::net::TcpListener::bind(("127.0.0.1", base.saturating_add(i))))
            .collect();
        if held.is_ok() && base.checked_add(n).is_some() {
            return Ok(base);
        }
    }
    anyhow::bail!("no {n} consecutive free loopback ports found")
}
