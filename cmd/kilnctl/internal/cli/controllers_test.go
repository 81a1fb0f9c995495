package cli

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func TestWriteControllers(t *testing.T) {
	for _, tc := range []struct {
		name string
		resp *controllerv1.ListControllersResponse
		want string
	}{
		{
			name: "sharded, one shard unowned",
			resp: &controllerv1.ListControllersResponse{
				Shards: 4, Hosts: 10, UnownedShards: []int32{3}, UnownedHosts: 2,
				Controllers: []*controllerv1.ControllerReplica{
					{Id: "c1", Leader: true, Registered: true, ShardMember: true, Shards: []int32{0, 1}, Hosts: 5},
					{Id: "c2", Registered: true, ShardMember: true, Shards: []int32{2}, Hosts: 3},
					{Id: "api", Registered: true},
				},
			},
			want: "" +
				"NAME   LEADER   SHARDS   HOSTS   SHARD-IDS\n" +
				"c1     *        2        5       0,1\n" +
				"c2     -        1        3       2\n" +
				"api    -        -        -       -\n" +
				"4 shards, 10 hosts; unowned shards: 3 (2 hosts)\n",
		},
		{
			name: "not sharded",
			resp: &controllerv1.ListControllersResponse{
				Hosts: 7,
				Controllers: []*controllerv1.ControllerReplica{
					{Id: "a", Leader: true, Registered: true},
					{Id: "b", Registered: true},
				},
			},
			want: "" +
				"NAME   LEADER   SHARDS   HOSTS   SHARD-IDS\n" +
				"a      *        -        -       -\n" +
				"b      -        -        -       -\n" +
				"not sharded: the leader runs the host lifecycle of all 7 hosts\n",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			require.NoError(t, writeControllers(&b, tc.resp))
			require.Equal(t, tc.want, b.String())
		})
	}
}
