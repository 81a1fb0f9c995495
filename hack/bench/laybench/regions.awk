# Durations of the runtime/trace regions of agent/lay in an execution trace:
#   laybench lay ... -trace t.out
#   go tool trace -d=parsed t.out | awk -f hack/bench/laybench/regions.awk
# prints, per region type, how many, the mean and the sum of their durations.
/Region(Begin|End)/ {
	for (i = 1; i <= NF; i++) {
		if ($i ~ /^G=/) g = $i
		if ($i ~ /^Time=/) { t = substr($i, 6) }
		if ($i ~ /^Type=/) ty = $i
	}
	if ($0 ~ /RegionBegin/) st[g ty] = t
	else { d = (t - st[g ty]) / 1e6; n[ty]++; s[ty] += d }
}
END { for (k in n) printf "%s n=%d mean=%.2f ms sum=%.3f s\n", k, n[k], s[k] / n[k], s[k] / 1000 }
