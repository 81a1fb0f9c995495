// Command kiln-chassis is the chassis_control program of the lab's ipmi_sim
// BMCs: `kiln-chassis SOCKET get|set PARM [VAL]...`. It forwards ipmi_sim's
// request to the lab's control socket and prints the answer. See package
// e2e/lab/ipmisim.
package main

import (
	"os"

	"github.com/kilnhq/kiln/e2e/lab/ipmisim"
)

func main() {
	os.Exit(ipmisim.RunChassis(os.Args[1:], os.Stdout))
}
