"""Operations: the `pdserve` CLI, the cluster status, its history, the operator dashboard and
the Prometheus metrics."""
