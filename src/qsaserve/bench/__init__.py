"""`qsaserve bench latency|throughput`: engine speed on random-weight models, printed as JSON."""
