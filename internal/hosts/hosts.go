// Package hosts groups a job's ranks by the host they run on.
package hosts

// Group takes hosts[r], any value that names rank r's host, and returns for every rank
// the index of its host (hosts numbered in the order their first rank appears) and its
// place among that host's ranks, and for every host its ranks in ascending order.
func Group(hosts []int) (hostOf, local []int, members [][]int) {
	hostOf, local = make([]int, len(hosts)), make([]int, len(hosts))
	idx := map[int]int{}
	for r, h := range hosts {
		i, ok := idx[h]
		if !ok {
			i = len(members)
			idx[h] = i
			members = append(members, nil)
		}
		hostOf[r], local[r] = i, len(members[i])
		members[i] = append(members[i], r)
	}
	return hostOf, local, members
}
