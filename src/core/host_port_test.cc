#include "core/host_port.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

TEST(HostPort, ParsesNamesIpv4AndBracketedIpv6) {
    auto a = ParseHostPort("127.0.0.1:8000");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->host, "127.0.0.1");
    EXPECT_EQ(a->port, 8000);
    auto b = ParseHostPort("prefill-0.cluster.local:65535");
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->host, "prefill-0.cluster.local");
    EXPECT_EQ(b->port, 65535);
    auto c = ParseHostPort("[::1]:7000");
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->host, "::1");
    EXPECT_EQ(c->port, 7000);
    // Port 0 only where the caller allows it (a listen address: any free port).
    EXPECT_FALSE(ParseHostPort("127.0.0.1:0").ok());
    auto any = ParseHostPort("0.0.0.0:0", 0);
    ASSERT_TRUE(any.ok());
    EXPECT_EQ(any->port, 0);
}

TEST(HostPort, NamesWhatIsWrong) {
    struct Case {
        const char* text;
        const char* says;
    };
    for (const Case& c :
         {Case{"nowhere", "is not host:port"}, Case{":80", "is not host:port"},
          Case{"host:", "the port is not a number"}, Case{"host:8o", "the port is not a number"},
          Case{"host:-1", "the port is not a number"},
          Case{"host:123456", "the port is not a number"},
          Case{"host:65536", "port 65536 is not 1..65535"},
          Case{"::1:80", "an IPv6 host goes in brackets"},
          Case{"[::1]80", "is not [ipv6-host]:port"}, Case{"[::1", "is not [ipv6-host]:port"},
          Case{"[]:80", "is not [ipv6-host]:port"}}) {
        auto r = ParseHostPort(c.text);
        ASSERT_FALSE(r.ok()) << c.text;
        EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << c.text;
        EXPECT_NE(r.status().message().find(c.says), std::string::npos)
            << c.text << ": " << r.status().ToString();
        EXPECT_NE(r.status().message().find(c.text), std::string::npos) << c.text;
    }
}

TEST(HostPort, FormatsWhatItParsesAndFindsAPeersHost) {
    for (const char* text : {"10.0.0.7:51234", "[fe80::1]:9", "decode-3:8100"}) {
        auto hp = ParseHostPort(text);
        ASSERT_TRUE(hp.ok()) << text;
        EXPECT_EQ(FormatHostPort(hp->host, hp->port), text);
    }
    EXPECT_EQ(HostOf("10.0.0.7:51234"), "10.0.0.7");
    EXPECT_EQ(HostOf("[::1]:51234"), "::1");
    EXPECT_EQ(HostOf("unix-socket"), "unix-socket");
}

// The peers a worker without a secret takes admin routes from: this machine's loopback only.
TEST(HostPort, OnlyLoopbackPeersAreLoopback) {
    for (const char* h : {"127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1"}) {
        EXPECT_TRUE(IsLoopbackHost(h)) << h;
    }
    for (const char* h : {"10.0.0.7", "128.0.0.1", "126.255.255.255", "::2", "::ffff:10.0.0.1",
                          "fe80::1", "localhost", "", "127.0.0.1:80", "0.0.0.0", "::"}) {
        EXPECT_FALSE(IsLoopbackHost(h)) << h;
    }
    EXPECT_TRUE(IsLoopbackHost(HostOf("[::1]:51234")));
    EXPECT_FALSE(IsLoopbackHost(HostOf("10.0.0.7:51234")));
}

}  // namespace
}  // namespace ferry
