package cli

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"regexp"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kilnhq/kiln/controller/bootserver"
	"github.com/kilnhq/kiln/internal/errdefs"
	controllerv1 "github.com/kilnhq/kiln/proto/kiln/controller/v1"
)

func (a *app) dnsmasqConfigCommand() *cobra.Command {
	var (
		o             bootserver.DnsmasqOptions
		rng           string
		hosts         []string
		fromCtl       bool
		selector      []string
		interfaceName string
	)
	cmd := &cobra.Command{
		Use:   "dnsmasq-config --interface IF --range START,END --boot-url URL [--host MAC,IP,NAME]...",
		Short: "Print a dnsmasq configuration that PXE-boots hosts into the controller's iPXE scripts",
		Long: `Print a dnsmasq configuration for PXE hosts (IPMI-only racks): DHCP on one
interface only, no DNS, a fixed address per host, and for iPXE clients the
host's script on the controller's boot server (BOOT_URL/boot/ipxe/NAME), which
carries a one-time boot token for that host. Kiln does not run a DHCP server:
give this file to the dnsmasq of the provisioning network.

  kilnctl dnsmasq-config --interface br-prov --range 10.77.0.100,10.77.0.200 \
    --boot-url http://10.77.0.1:8080 --host 52:54:00:12:34:56,10.77.0.11,rack1-01 \
    > /etc/dnsmasq.d/kiln.conf
  dnsmasq --test --conf-file=/etc/dnsmasq.d/kiln.conf

--range START (one address) makes a static range: only the listed hosts get
addresses. --from-controller adds every Host with a spec.bootMac (address from
the range); it is the only option that calls the controller.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.Interface = interfaceName
			if err := checkDnsmasqFlags(&o, rng); err != nil {
				return err
			}
			seen := map[string]bool{}
			for _, h := range hosts {
				dh, err := parseDnsmasqHost(h)
				if err != nil {
					return err
				}
				if seen[dh.Name] {
					return errdefs.InvalidArgument("dnsmasq-config: host %q is given twice", dh.Name)
				}
				seen[dh.Name] = true
				o.Hosts = append(o.Hosts, dh)
			}
			if fromCtl {
				sel, err := parseSelector(selector)
				if err != nil {
					return err
				}
				more, err := a.bootHosts(cmd, sel)
				if err != nil {
					return err
				}
				for _, dh := range more {
					if !seen[dh.Name] { // --host wins: it can pin an address
						seen[dh.Name] = true
						o.Hosts = append(o.Hosts, dh)
					}
				}
			}
			_, err := fmt.Fprint(cmd.OutOrStdout(), bootserver.DnsmasqConfig(o))
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&interfaceName, "interface", "", "the only interface dnsmasq answers on (the provisioning network)")
	f.StringVar(&rng, "range", "", "DHCP pool START,END, or START alone for a static range (only --host addresses)")
	f.StringVar(&o.Netmask, "netmask", "", "netmask of the range (default 255.255.255.0)")
	f.StringVar(&o.LeaseTime, "lease-time", "", "DHCP lease time (default 1h)")
	f.StringVar(&o.Router, "router", "", "default gateway handed out (default none)")
	f.StringVar(&o.BootServer, "boot-url", "", "the controller's boot server as hosts reach it (kiln-controller run --boot-listen/--boot-url)")
	f.StringArrayVar(&hosts, "host", nil, "a host to boot: MAC,IP,NAME or MAC,NAME; repeatable")
	f.BoolVar(&fromCtl, "from-controller", false, "also add the controller's Hosts that have a spec.bootMac")
	f.StringArrayVarP(&selector, "selector", "l", nil, "with --from-controller: label selector key=value[,key=value]")
	f.StringVar(&o.TFTPRoot, "tftp-root", "", "serve TFTP from this directory and chain-load firmware PXE into iPXE (undionly.kpxe, ipxe.efi)")
	f.BoolVar(&o.EnableRA, "enable-ra", false, "send IPv6 router advertisements (stops iPXE waiting ~13 s for IPv6)")
	f.StringVar(&o.LeaseFile, "lease-file", "", "dnsmasq lease file (default dnsmasq's)")
	f.StringVar(&o.PIDFile, "pid-file", "", "dnsmasq PID file (default dnsmasq's)")
	return cmd
}

// ifaceRE is what Linux accepts as an interface name, without the
// characters that would end a dnsmasq option.
var ifaceRE = regexp.MustCompile(`^[A-Za-z0-9_.:@-]{1,15}$`)

// checkDnsmasqFlags validates the flags and fills o's range; the output
// must never be a file dnsmasq reads differently than asked.
func checkDnsmasqFlags(o *bootserver.DnsmasqOptions, rng string) error {
	if !ifaceRE.MatchString(o.Interface) {
		return errdefs.InvalidArgument("dnsmasq-config: --interface %q: give the provisioning network's interface, such as br-prov", o.Interface)
	}
	u, err := url.Parse(o.BootServer)
	if o.BootServer == "" || err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || strings.ContainsAny(o.BootServer, ", \n") {
		return errdefs.InvalidArgument("dnsmasq-config: --boot-url %q: want the boot server's URL, such as http://10.77.0.1:8080", o.BootServer)
	}
	start, end, _ := strings.Cut(rng, ",")
	if start == "" {
		return errdefs.InvalidArgument("dnsmasq-config: --range is required: START,END (a pool) or START (static: only --host addresses)")
	}
	for _, a := range []string{start, end} {
		if a == "" {
			continue
		}
		if ip, err := netip.ParseAddr(a); err != nil || !ip.Is4() {
			return errdefs.InvalidArgument("dnsmasq-config: --range %q: %q is not an IPv4 address", rng, a)
		}
	}
	o.RangeStart, o.RangeEnd = start, end
	for flag, v := range map[string]string{"--netmask": o.Netmask, "--router": o.Router} {
		if v == "" {
			continue
		}
		if ip, err := netip.ParseAddr(v); err != nil || !ip.Is4() {
			return errdefs.InvalidArgument("dnsmasq-config: %s %q is not an IPv4 address", flag, v)
		}
	}
	if o.LeaseTime != "" && !regexp.MustCompile(`^([0-9]+[smhd]?|infinite)$`).MatchString(o.LeaseTime) {
		return errdefs.InvalidArgument("dnsmasq-config: --lease-time %q: want dnsmasq's form, such as 1h, 45m or infinite", o.LeaseTime)
	}
	for flag, v := range map[string]string{"--tftp-root": o.TFTPRoot, "--lease-file": o.LeaseFile, "--pid-file": o.PIDFile} {
		if strings.ContainsAny(v, "\n\r") {
			return errdefs.InvalidArgument("dnsmasq-config: %s holds a line break", flag)
		}
	}
	return nil
}

// hostNameRE is a Host name (DNS labels, as the controller accepts them).
var hostNameRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$`)

// parseDnsmasqHost parses MAC,IP,NAME or MAC,NAME.
func parseDnsmasqHost(s string) (bootserver.DnsmasqHost, error) {
	parts := strings.Split(s, ",")
	var h bootserver.DnsmasqHost
	switch len(parts) {
	case 2:
		h = bootserver.DnsmasqHost{MAC: parts[0], Name: parts[1]}
	case 3:
		h = bootserver.DnsmasqHost{MAC: parts[0], IP: parts[1], Name: parts[2]}
	default:
		return h, errdefs.InvalidArgument("dnsmasq-config: --host %q: want MAC,IP,NAME or MAC,NAME", s)
	}
	return checkDnsmasqHost(h)
}

func checkDnsmasqHost(h bootserver.DnsmasqHost) (bootserver.DnsmasqHost, error) {
	mac, err := net.ParseMAC(h.MAC)
	if err != nil || len(mac) != 6 {
		return h, errdefs.InvalidArgument("dnsmasq-config: host %q: MAC %q is not an Ethernet address such as 52:54:00:12:34:56", h.Name, h.MAC)
	}
	h.MAC = mac.String()
	if h.IP != "" {
		if ip, err := netip.ParseAddr(h.IP); err != nil || !ip.Is4() {
			return h, errdefs.InvalidArgument("dnsmasq-config: host %q: %q is not an IPv4 address", h.Name, h.IP)
		}
	}
	if len(h.Name) > 253 || !hostNameRE.MatchString(h.Name) {
		return h, errdefs.InvalidArgument("dnsmasq-config: host name %q is not a lowercase DNS name such as rack1-01", h.Name)
	}
	return h, nil
}

// bootHosts lists the controller's Hosts with a boot MAC.
func (a *app) bootHosts(cmd *cobra.Command, sel map[string]string) ([]bootserver.DnsmasqHost, error) {
	c, err := a.client(cmd.Context())
	if err != nil {
		return nil, err
	}
	var out []bootserver.DnsmasqHost
	cont := ""
	for {
		ctx, cancel := a.call(cmd.Context())
		resp, err := c.List(ctx, &controllerv1.ListRequest{Kind: "hosts", LabelSelector: sel, Limit: 500, Continue: cont})
		cancel()
		if err != nil {
			return nil, a.rpcError("dnsmasq-config: list hosts", err)
		}
		for _, r := range resp.GetItems() {
			h := r.GetHost()
			if h.GetSpec().GetBootMac() == "" {
				continue
			}
			dh, err := checkDnsmasqHost(bootserver.DnsmasqHost{MAC: h.GetSpec().GetBootMac(), Name: h.GetMetadata().GetName()})
			if err != nil {
				return nil, err
			}
			out = append(out, dh)
		}
		if cont = resp.GetContinue(); cont == "" {
			return out, nil
		}
	}
}
