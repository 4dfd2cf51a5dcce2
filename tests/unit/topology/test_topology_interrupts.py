"""/proc/interrupts parsing and queue-vs-admin classification of vector names."""

from __future__ import annotations

import pytest

from numaserve.topology.interrupts import classify_irq, parse_interrupts

# captured on the test VM (kernel 6.18), trimmed
VM_INTERRUPTS = """\
           CPU0       CPU1       
 24:          1          0  IO-APIC   5-edge      ACPI:Ged
 26:          0         13  IO-APIC   4-edge      ttyS0
 37:          0          0 PCI-MSIX-0000:00:03.0   0-edge      virtio2-config
 38:          0        458 PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0
 39:        390          0 PCI-MSIX-0000:00:03.0   2-edge      virtio2-output.0
NMI:          0          0   Non-maskable interrupts
LOC:      11133      12591   Local timer interrupts
ERR:          0
MIS:          0
"""


def test_parse_vm_interrupts():
    names = parse_interrupts(VM_INTERRUPTS)
    assert names == {
        24: "ACPI:Ged",
        26: "ttyS0",
        37: "virtio2-config",
        38: "virtio2-input.0",
        39: "virtio2-output.0",
    }


def test_parse_chip_formats_shared_and_nameless_lines():
    text = (
        "            CPU0       CPU1       CPU2       CPU3\n"
        " 40:   1   2   3   4  IR-PCI-MSIX-0000:00:03.0 2-edge  virtio2-input.0\n"
        " 41:   1   2   3   4  IR-PCI-MSI 31457281-edge      i40e-ens1f0-TxRx-0\n"
        " 42:   1   2   3   4   PCI-MSI-edge      eth0-TxRx-0\n"  # old kernels: chip and type in one
        " 16:   1   2   3   4  IO-APIC  16-fasteoi   ehci_hcd:usb1, i801_smbus\n"
        " 17:   1   2   3   4  IO-APIC  17-fasteoi\n"  # counts but no action: no name
        " 11:   1   2   3   4  GICv3  27 Level     arch_timer\n"
        "IPI0:  5   5   5   5       Rescheduling interrupts\n"
    )
    assert parse_interrupts(text) == {
        40: "virtio2-input.0",
        41: "i40e-ens1f0-TxRx-0",
        42: "eth0-TxRx-0",
        16: "ehci_hcd:usb1, i801_smbus",
        17: None,
        11: "arch_timer",
    }


@pytest.mark.parametrize("text", ["", "\n", "garbage\n\x00\x01", "CPU0\n x: 1 2\n"])
def test_parse_garbage_is_empty_not_an_error(text):
    assert parse_interrupts(text) == {}


@pytest.mark.parametrize(
    "name, ifname, expected",
    [
        # mlx5: completion vectors are queues, async (and any other mlx5_*) admin
        ("mlx5_comp0@pci:0000:81:00.0", "eth0", ("queue", 0)),
        ("mlx5_comp13@pci:0000:81:00.0", "eth0", ("queue", 13)),
        ("mlx5_async0@pci:0000:81:00.0", "eth0", ("admin", None)),
        ("mlx5_async17@pci:0000:81:00.0", "eth0", ("admin", None)),
        ("mlx5_pages_eq@pci:0000:81:00.0", "eth0", ("admin", None)),
        # igb / ixgbe / ixgbevf: <if>-TxRx-n, -rx-n, -tx-n; bare <if> is the "other" vector
        ("eth1-TxRx-0", "eth1", ("queue", 0)),
        ("eth1-TxRx-7", "eth1", ("queue", 7)),
        ("eth1-rx-3", "eth1", ("queue", 3)),
        ("eth1-tx-2", "eth1", ("queue", 2)),
        ("eth1", "eth1", ("admin", None)),
        ("eth10-TxRx-1", "eth1", ("unknown", None)),  # another interface's vector
        # i40e / ice / iavf
        ("i40e-ens1f0-TxRx-0", "ens1f0", ("queue", 0)),
        ("i40e-ens1f0-TxRx-31", "ens1f0", ("queue", 31)),
        ("i40e-0000:3b:00.0:misc", "ens1f0", ("admin", None)),
        ("i40e-0000:3b:00.0:fdir-TxRx-0", "ens1f0", ("admin", None)),
        ("ice-ens2-TxRx-5", "ens2", ("queue", 5)),
        ("ice-0000:5e:00.0:misc", "ens2", ("admin", None)),
        ("iavf-ens4-TxRx-2", "ens4", ("queue", 2)),
        ("iavf-0000:00:05.0:mbx", "ens4", ("admin", None)),
        # virtio-net
        ("virtio2-input.0", "eth0", ("queue", 0)),
        ("virtio3-output.3", "eth0", ("queue", 3)),
        ("virtio2-config", "eth0", ("admin", None)),
        # mlx4 (fixture 32em64t's ib0)
        ("mlx4-3@0000:82:00.0", "ib0", ("queue", 3)),
        ("mlx4-async@pci:0000:82:00.0", "ib0", ("admin", None)),
        # ena
        ("ena-mgmnt@pci:0000:00:05.0", "ens5", ("admin", None)),
        ("ens5-Tx-Rx-0", "ens5", ("queue", 0)),
        # nothing to go on
        (None, "eth0", ("unknown", None)),
        ("", "eth0", ("unknown", None)),
        ("bnxt_en-something", "eth0", ("unknown", None)),
        ("virtio2-req.0", "eth0", ("unknown", None)),
    ],
)
def test_classify(name, ifname, expected):
    assert classify_irq(name, ifname) == expected
